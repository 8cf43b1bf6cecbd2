"""ZeRO-3's deferred init ([Note: deferred init] in ``longboat/strategies/zero/init.py``): a
model built on the meta device starts where the same model built eagerly starts (the model's
own initialisation, not each module's ``reset_parameters()``), a ``param_init_fn`` or
``zero.init_method`` is used when given, and what cannot be made is refused by name on every
rank, without a hang."""

from __future__ import annotations

import re
from typing import Any

import harness
import pytest
import torch
from torch import nn

from longboat.config import ConfigError

VOCAB, SEQ = 512, 32


def _build(kind: str) -> nn.Module:
    """A small language model of ``kind``: longboat's GPT, transformers' GPT-2 or Llama."""
    if kind == "gpt":
        from longboat.models import GPT

        return GPT(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, seq_len=SEQ)
    import transformers as tf

    ids = {"bos_token_id": 0, "eos_token_id": 0}
    if kind == "gpt2":
        drop = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        cfg = tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=SEQ, **drop, **ids
        )
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        **ids,
    )
    return tf.LlamaForCausalLM(cfg)


def _groups(net: nn.Module) -> list[dict[str, Any]]:
    # Weight decay on matrices only, as transformers' trainers do: a unit comes in two pieces,
    # each made whole at the first.
    params = list(net.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _cfg(units: list[str] | None = None, **zero: Any) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": 3, **zero}
    if units:
        z["unit_classes"] = units
    return {**harness.QUIET, "strategy": "zero", "zero": z, "batch": {"train_batch_size": 8}}


def _first_step(kind: str, device: str, units: list[str] | None) -> dict[str, Any]:
    """One training step of ``kind`` built on ``device`` under ZeRO-3: its first loss, its
    starting state (whole), its buffers, and whether the tied head is still the embedding."""
    import longboat
    from longboat.models import gpt_loss, synthetic_tokens

    torch.manual_seed(0)
    with torch.device(device):
        net = _build(kind)
    engine = longboat.initialize(net, torch.optim.AdamW(_groups(net), lr=1e-3), _cfg(units))
    start = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    x, y = synthetic_tokens(4, SEQ, VOCAB, torch.Generator().manual_seed(1))
    out = engine(x)
    loss = gpt_loss(out if isinstance(out, torch.Tensor) else out.logits, y)
    engine.backward(loss)
    engine.step()
    emb = net.tok_emb if kind == "gpt" else net.get_input_embeddings()
    tied = net.lm_head.weight is emb.weight
    result = {
        "loss": loss.item(),
        "start": start,
        "buffers": {n: b.clone() for n, b in net.named_buffers()},
        "tied": tied,
    }
    engine.close()
    return result


@pytest.mark.parametrize(
    ("kind", "units"),
    [
        ("gpt", None),
        ("gpt", ["_Block"]),
        ("gpt2", None),
        ("gpt2", ["GPT2Block"]),
        ("llama", None),
        ("llama", ["LlamaDecoderLayer"]),
    ],
    ids=["gpt", "gpt-blocks", "gpt2", "gpt2-blocks", "llama", "llama-layers"],
)
def test_a_model_built_on_meta_starts_as_the_eager_one(ranks, kind, units):
    # Before the model's own initialisation was used, the meta GPT's first loss was 87 (ln V =
    # 6.24) and GPT-2 and Llama were refused (Conv1D and RMSNorm have no reset_parameters, the
    # rotary inv_freq is a buffer on meta).
    eager = ranks(2, _first_step, kind, "cpu", units)
    meta = ranks(2, _first_step, kind, "meta", units)
    assert meta[1]["start"].keys() == meta[0]["start"].keys()
    for k, v in meta[0]["start"].items():  # rank 0's values everywhere
        assert torch.equal(meta[1]["start"][k], v), k
    want, got = eager[0]["start"], meta[0]["start"]
    assert got.keys() == want.keys()
    for k, e in want.items():
        if e.std() == 0:  # ones and zeros: exactly
            assert torch.equal(got[k], e), k
        else:
            assert abs(got[k].std() - e.std()) <= 0.05 * e.std(), (k, got[k].std(), e.std())
    for r in range(2):
        assert abs(meta[r]["loss"] - eager[r]["loss"]) <= 0.02 * eager[r]["loss"]
        assert meta[r]["tied"] == eager[r]["tied"] == (kind != "llama")
    # transformers' rotary inv_freq (a buffer left on meta, not saved) recomputed by its own
    # _init_weights; GPT and GPT-2 have none
    buffers = eager[0]["buffers"]
    assert buffers.keys() == meta[0]["buffers"].keys()
    assert bool(buffers) == (kind == "llama")
    for n, b in buffers.items():
        assert torch.allclose(meta[0]["buffers"][n], b), n


# -- what the user gives ------------------------------------------------------------------------

CALLED: list[str] = []


def _half(module: nn.Module) -> None:
    CALLED.append(type(module).__name__)
    for p in module.parameters(recurse=False):
        nn.init.constant_(p, 0.5)


def _with_param_init_fn() -> dict[str, Any]:
    import longboat
    from longboat.models import GPT

    with torch.device("meta"):
        net = GPT(vocab_size=64, d_model=16, n_layers=2, n_heads=2, seq_len=8)
    CALLED.clear()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = longboat.initialize(net, opt, _cfg(["_Block"]), param_init_fn=_half)
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return {"state": state, "called": sorted(CALLED)}


def test_param_init_fn_initialises_each_owning_module(ranks):
    for r in ranks(2, _with_param_init_fn):
        assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in r["state"].values())
        # the modules that own parameters, once each (the head and the embedding share one
        # Parameter and both own it), never a container
        per_block = ["LayerNorm", "LayerNorm", "Linear", "Linear", "Linear", "Linear"]
        want = sorted(["Embedding", "Embedding", "LayerNorm", "Linear", *per_block * 2])
        assert r["called"] == want


class _Scaled(nn.Module):
    """A model whose own parameter has no reset_parameters(): only its initialiser knows it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale

    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.25)
            nn.init.zeros_(module.bias)
        if module is self:
            nn.init.constant_(self.scale, 2.0)


def _with_init_method(name: str) -> dict[str, torch.Tensor]:
    import longboat

    with torch.device("meta"):
        net = _Scaled()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    engine = longboat.initialize(net, opt, _cfg(init_method=name))
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return state


def test_init_method_from_the_config_initialises_the_model(ranks):
    for state in ranks(2, _with_init_method, "init_module"):
        assert torch.equal(state["scale"], torch.full((4,), 2.0))
        for k, v in state.items():
            if k.endswith("weight"):
                assert torch.equal(v, torch.full_like(v, 0.25)), k
            elif k.endswith("bias"):
                assert torch.equal(v, torch.zeros_like(v)), k


# -- refused by name -----------------------------------------------------------------------------


def _boom(module: nn.Module) -> None:
    raise ValueError("cannot initialise this")


def _boom_on_rank_0(module: nn.Module) -> None:
    if torch.distributed.get_rank() == 0:
        raise ValueError("cannot initialise this on rank 0")
    _half(module)


def _refused(model: str, fn: Any = None, init_method: str | None = None) -> str:
    """What initializing ``model`` built on meta raises on this rank."""
    import longboat
    from longboat.models import GPT

    with torch.device("meta"):
        if model == "gpt":
            net: nn.Module = GPT(vocab_size=64, d_model=16, n_layers=2, n_heads=2, seq_len=8)
        else:
            net = _Scaled()
        if model == "table":
            net.body[1].register_buffer("table", torch.arange(4.0))  # a buffer nothing makes
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    cfg = _cfg(["_Block"] if model == "gpt" else None, init_method=init_method)
    try:
        longboat.initialize(net, opt, cfg, param_init_fn=fn).close()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_what_cannot_be_initialised_is_refused_by_name_on_every_rank(ranks):
    (text,) = ranks(1, _refused, "gpt", None, "init_weights")
    assert text.startswith(f"{ConfigError.__name__}: key 'zero.init_method' has value ")
    assert "'init_weights', but GPT has no method 'init_weights'" in text

    for text in ranks(2, _refused, "gpt", _boom, timeout=60):
        assert re.fullmatch(
            r"RuntimeError: param_init_fn _boom raised on module '[\w.]+' \(\w+\) while making "
            r"the meta device's model: ValueError: cannot initialise this",
            text,
        ), text

    # On one rank only: the others do not wait for its broadcast, they name it.
    first, other = ranks(2, _refused, "gpt", _boom_on_rank_0, timeout=60)
    assert "param_init_fn _boom_on_rank_0 raised on module" in first
    assert "model failed on rank 0 (param_init_fn _boom_on_rank_0 raised on module" in other

    # A parameter no initialiser knows: _Scaled.scale without its init_method.
    (text,) = ranks(1, _refused, "scaled")
    assert text.startswith(f"{ConfigError.__name__}: scale stayed uninitialised after ")
    assert "reset_parameters() ran" in text and "give _Scaled a reset_parameters()" in text

    # A buffer on meta that nothing recomputes: the way to build it instead.
    (text,) = ranks(1, _refused, "table", None, "init_module")
    assert "body.1.table stayed uninitialised after reset_parameters() and " in text
    assert "accelerate's init_empty_weights() does" in text
