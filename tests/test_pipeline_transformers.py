"""Pipeline stages of Hugging Face transformers models without a ``pipeline_layers()`` method:
GPT-2 and the Llama-shaped families, split by their built-in layers
(``longboat/pipeline/transformers_layers.py``), against the model's own forward and against a
plain PyTorch loop that calls it."""

from __future__ import annotations

import copy
from typing import Any

import harness
import pytest
import reference
import torch
from torch import nn

import longboat

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, STEPS, BATCH, ACCUMULATION = 128, 16, 3, 8, 2


def _hf(kind: str, layers: int = 2, **extra: Any) -> nn.Module:
    """A small model built from a config (nothing downloaded), dropout off, seeded."""
    tf = transformers
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=layers, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            **extra,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    config, model = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[kind]
    cfg = config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **extra,
    )  # fmt: skip
    return model(cfg)


# -- the layers are the model's forward (no processes) -----------------------------------------

FORWARDS = {
    "gpt2": ("gpt2", {}),
    "gpt2-eager": ("gpt2", {"attn_implementation": "eager"}),
    "llama": ("llama", {}),
    "llama-eager": ("llama", {"attn_implementation": "eager"}),
    "mistral-window": ("mistral", {"sliding_window": 4}),  # shorter than the sequence
    "qwen2": ("qwen2", {}),
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
}


@pytest.mark.parametrize("case", list(FORWARDS))
def test_built_in_layers_in_two_stages_are_the_models_forward(case):
    from longboat.pipeline import layered

    kind, extra = FORWARDS[case]
    model = _hf(kind, **extra)
    x = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    want = model(x).logits
    keys = list(model.state_dict())
    split = copy.deepcopy(model)
    bounds = layered.boundaries(split, 2, "uniform")
    layered.split(split, bounds, held=[0, 1])
    got = split(split(x, stage=0), stage=1)
    assert torch.equal(got, want), "the same operations in the same order"
    assert list(split.state_dict()) == keys, "the model's own names"


def test_a_model_the_layers_do_not_fit_is_refused_by_name():
    from longboat.pipeline import stages

    with pytest.raises(TypeError, match="add_cross_attention"):
        stages.plan(_hf("gpt2", add_cross_attention=True), 2, None)

    class Mine(transformers.GPT2LMHeadModel):  # its forward may differ: not guessed
        pass

    with pytest.raises(TypeError, match=r"GPT2LMHeadModel, LlamaForCausalLM.*Mine is none"):
        stages.as_layers(Mine(_hf("gpt2").config), None)


# -- training through stages, against the plain loop --------------------------------------------


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        seq = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _config(pp: int, schedule: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        **harness.QUIET,
        "mesh": {"pp": pp},
        "pipeline": {"schedule": schedule},
        "gradient_clipping": 1.0,  # the norm sums over stages and counts a tied weight once
        "batch": {"train_batch_size": BATCH, "gradient_accumulation_steps": ACCUMULATION},
        # SGD: Adam would turn the rounding noise of gradients that are zero in exact arithmetic
        # into steps of the full learning rate
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        **extra,
    }


def _train(kind: str, cfg: dict[str, Any], save: str | None) -> dict[str, Any]:
    engine = longboat.initialize(_hf(kind), None, cfg)
    dp = engine.topology.data("dp")  # each data-parallel rank its share of the step's samples
    losses = [
        engine.train_step(
            tuple(t.chunk(dp.world_size)[dp.rank] for t in b), lambda out, mb: _loss(out, mb[1])
        )
        for b in _batches()
    ]
    if save:
        engine.save_checkpoint(save)
    out = {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "dp": dp.rank,
    }
    engine.close()
    return out


def _plain(kind: str, micro: int) -> tuple[list[float], nn.Module]:
    """The plain loop: the whole model's own forward, micro-batches of ``micro`` over the
    step's samples, each loss divided by their number."""
    model = _hf(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = []
    for x, y in _batches():
        opt.zero_grad(set_to_none=True)
        total, n = 0.0, BATCH // micro
        for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
            loss = _loss(model(xm).logits, ym)
            (loss / n).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        plain.append(total / n)
    return plain, model


CASES = {
    "gpt2-gpipe": ("gpt2", 2, "gpipe", {}),
    "gpt2-1f1b": ("gpt2", 2, "1f1b", {}),  # and its checkpoint
    "llama-gpipe": ("llama", 2, "gpipe", {}),
    "llama-1f1b": ("llama", 2, "1f1b", {}),
    "gpt2-1f1b-x-replicate": ("gpt2", 4, "1f1b", {"strategy": "replicate"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_pipeline_equals_plain_pytorch(ranks, tmp_path, case):
    kind, world, schedule, extra = CASES[case]
    save = str(tmp_path) if case == "gpt2-1f1b" else None
    results = ranks(world, _train, kind, _config(2, schedule, extra), save)
    dp = world // 2
    plain, model = _plain(kind, BATCH // (ACCUMULATION * dp))
    for stage in range(2):  # ranks stage*dp .. stage*dp+dp-1, each its own samples
        mine = [results[stage * dp + d]["losses"] for d in range(dp)]
        means = [sum(step) / dp for step in zip(*mine, strict=True)]
        assert means == pytest.approx(plain, rel=1e-5), f"stage {stage}"
    want = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in r["state"].items():
            if k in state:  # a data-parallel peer, or the weight tied across the stages
                assert torch.equal(state[k], v), k
            state[k] = v
    assert set(state) == set(want), "the model's own keys, on the stages together"
    assert reference.max_rel_diff(state, want) <= 1e-5
    if kind == "gpt2":  # the head and the embedding are one tied weight on two stages
        assert "lm_head.weight" not in results[0]["state"]
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    if save:
        from safetensors.torch import load_file

        from longboat.checkpoint.inspect import consolidate

        whole = load_file(str(consolidate(tmp_path, tmp_path / "whole.safetensors")))
        assert set(whole) == set(want), "every key of the model's own, tied ones included"
        assert reference.max_rel_diff(whole, state) == 0.0
        fresh = _hf(kind)
        fresh.load_state_dict(whole)  # strict: every key of the model's own, nothing else
