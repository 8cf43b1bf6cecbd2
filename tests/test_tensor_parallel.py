"""Tensor parallelism (``longboat.tensor``): layouts and plans without processes, then training
on gloo ranks against the plain single-process loop, checkpoints across layouts, and refusals."""

from __future__ import annotations

import re
from typing import Any

import harness
import pytest
import reference
import torch
from torch import nn

import longboat
from longboat.pieces import Slices
from longboat.tensor.layout import LayoutError, Split
from longboat.tensor.plans import GPT as GPT_PLAN
from longboat.tensor.plans import matches, style_of
from longboat.testing import RankFailure

# -- layouts and plans, without processes -------------------------------------------------------


def test_a_fused_weight_gives_each_rank_its_chunk_of_every_block():
    full = torch.arange(12 * 2).view(12, 2)  # q|k|v stacked: 3 blocks of 4 rows
    split = Split(0, parts=3)
    r0, r1 = split.local(full, 0, 2), split.local(full, 1, 2)
    # rank 0: q rows 0-1, k rows 4-5, v rows 8-9 -- not the first half of the matrix
    assert r0[:, 0].tolist() == [0, 2, 8, 10, 16, 18]
    assert r1[:, 0].tolist() == [4, 6, 12, 14, 20, 22]
    assert torch.equal(split.whole([r0, r1], (12, 2)), full)
    assert split.slices((12, 2), 1, 2) == Slices(
        0, (((2, 2), (0, 2)), ((6, 2), (0, 2)), ((10, 2), (0, 2)))
    )


@pytest.mark.parametrize(
    ("shape", "split", "size"),
    [((6, 4), Split(1), 2), ((8, 3), Split(0), 4), ((6, 5), Split(0, 3), 2)],
)
def test_slices_take_and_put_are_inverse(shape, split, size):
    full = torch.randn(shape)
    out = torch.zeros(shape)
    for r in range(size):
        sl = split.slices(shape, r, size)
        local = sl.take(full)
        assert tuple(local.shape) == sl.shape and local.numel() == sl.numel
        sl.put(out, local)
    assert torch.equal(out, full)
    assert Slices.from_json(split.slices(shape, 1, size).to_json()) == split.slices(shape, 1, size)


def test_a_width_that_does_not_divide_is_named():
    with pytest.raises(
        LayoutError, match=r"blocks.0.attn.qkv.weight: dimension 0 .*3 fused blocks of 6.*tp = 4"
    ):
        Split(0, 3).check("blocks.0.attn.qkv.weight", (18, 6), 4)


def test_patterns_name_one_component_per_wildcard():
    assert matches("blocks.*.attn.qkv", "blocks.11.attn.qkv")
    assert not matches("blocks.*.attn.qkv", "blocks.0.x.attn.qkv")
    assert not matches("blocks.*.attn", "blocks.0.attn.qkv")
    assert GPT_PLAN.style_for("blocks.3.mlp.fc") is not None
    assert GPT_PLAN.style_for("blocks.3.mlp") is None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("diagonal", "unknown style"),
        ({"style": "rowwise", "fused": 3}, "colwise layers only"),
        (["colwise"], "give a style name"),
    ],
)
def test_bad_styles_are_refused_by_key(value, words):
    with pytest.raises(LayoutError, match=words):
        style_of("tensor_parallel.plan['x']", value)


# -- training against the plain loop -----------------------------------------------------------

STEPS = 4
BATCH = 8  # samples per optimizer step, in 2 micro-batches per data-parallel rank
SEQ = 8


def _gpt(tie: bool, heads: int = 4) -> nn.Module:
    from longboat.models import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=heads, seq_len=SEQ, tie_weights=tie)


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        **harness.QUIET,
        "gradient_clipping": 0.5,  # small enough to clip: the global norm must be the true one
        "batch": {"train_batch_size": BATCH, "gradient_accumulation_steps": 2},
        # SGD: Adam would turn the rounding noise of gradients that are zero in exact
        # arithmetic (a key bias: softmax ignores it) into steps of the full learning rate
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        **extra,
    }


def _train(cfg: dict[str, Any], steps: int, tie: bool) -> dict[str, Any]:
    model = _gpt(tie)
    engine = longboat.initialize(model, None, cfg)
    dp = engine.topology.data("dp")
    losses = [
        engine.train_step(
            tuple(t.chunk(dp.world_size)[dp.rank] for t in b), lambda out, mb: _loss(out, mb[1])
        )
        for b in _batches(steps)
    ]
    with engine.gathered_parameters():  # whole over dp (ZeRO-3), this rank's tp slices
        local = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
    out = {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
        "local": local,
        "norm": float(engine.last_grad_norm),
    }
    # Whole tensors in, whole tensors out: load_state_dict cuts each rank's slices.
    doubled = {k: v * 2 for k, v in out["state"].items()}
    engine.load_state_dict(doubled)
    out["reloaded"] = reference.max_rel_diff(engine.state_dict(), doubled)
    engine.close()
    return out


def _plain(steps: int, tie: bool, micro: int) -> tuple[list[float], nn.Module, Any, float]:
    """The single-process loop over the same samples, in micro-batches of ``micro``."""
    model = _gpt(tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norm = [], 0.0
    for x, y in _batches(steps):
        opt.zero_grad(set_to_none=True)
        total, n = 0.0, BATCH // micro
        for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
            loss = _loss(model(xm), ym)
            (loss / n).backward()
            total += float(loss.detach())
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        opt.step()
        losses.append(total / n)
    return losses, model, opt, norm


CASES = {
    "tp2": (2, {"mesh": {"tp": 2}}),
    "tp4": (4, {"mesh": {"tp": 4}}),
    "tp2-sequence": (2, {"mesh": {"tp": 2}, "tensor_parallel": {"sequence_parallel": True}}),
    "tp2xzero2": (4, {"mesh": {"tp": 2}, "strategy": "zero", "zero": {"stage": 2}}),
    "tp2xzero3": (4, {"mesh": {"tp": 2}, "strategy": "zero", "zero": {"stage": 3}}),
    "tp2xreplicate-sequence": (
        4,
        {
            "mesh": {"tp": 2},
            "strategy": "replicate",
            "tensor_parallel": {"sequence_parallel": True},
        },
    ),
}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_equals_plain_pytorch(ranks, case, tie):
    world, extra = CASES[case]
    results = ranks(world, _train, _config(extra), STEPS, tie)
    tp = extra["mesh"]["tp"]
    dp = world // tp
    plain, model, opt, norm = _plain(STEPS, tie, BATCH // (2 * dp))
    for d in range(dp):  # each data-parallel rank's mean loss; its tp ranks agree exactly
        group = results[d * tp : (d + 1) * tp]
        assert all(r["losses"] == group[0]["losses"] for r in group)
    losses = [
        sum(x) / dp for x in zip(*(results[d * tp]["losses"] for d in range(dp)), strict=True)
    ]
    assert losses == pytest.approx(plain, rel=1e-5)
    for r in results:
        assert r["reloaded"] == 0.0
        assert r["norm"] == pytest.approx(norm, rel=1e-5)
        assert reference.max_rel_diff(r["state"], model.state_dict()) <= 1e-5
    # the layers are divided: this rank holds a quarter / half of the head and of q|k|v
    assert results[0]["local"]["blocks.0.attn.qkv.weight"] == (96 // tp, 32)
    assert results[0]["local"]["blocks.0.attn.proj.weight"] == (32, 32 // tp)
    assert results[0]["local"]["tok_emb.weight"] == (64 // tp, 32)  # and the head (tied or not)
    names = {id(p): n for n, p in model.named_parameters()}
    got = harness.assemble(results)
    for p, st in opt.state.items():
        name = names[id(p)]
        want = st["momentum_buffer"]
        assert reference.max_rel_diff({name: got[name]["momentum_buffer"]}, {name: want}) <= 1e-5


def _train_stages(cfg: dict[str, Any], steps: int, tie: bool) -> dict[str, Any]:
    engine = longboat.initialize(_gpt(tie), None, cfg)
    losses = [engine.train_step(b, lambda out, mb: _loss(out, mb[1])) for b in _batches(steps)]
    out = {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
    }
    engine.close()
    return out


@pytest.mark.parametrize(
    ("tie", "schedule"),
    [(False, "1f1b"), (True, "1f1b"), (True, "zb-h1")],
    ids=["untied", "tied", "tied-zb-h1"],
)
def test_tensor_parallel_within_pipeline_stages_equals_plain_pytorch(ranks, tie, schedule):
    # pp 2 x tp 2: ranks 0, 1 hold the first stage's layers, divided; ranks 2, 3 the second's.
    # zb-h1: the divided layers' backward collectives run in the input-gradient pass.
    pipeline = {"partition": "uniform", "schedule": schedule}
    cfg = _config({"mesh": {"pp": 2, "tp": 2}, "pipeline": pipeline})
    results = ranks(4, _train_stages, cfg, STEPS, tie)
    plain, model, _, _ = _plain(STEPS, tie, BATCH // 2)
    want = model.state_dict()
    for r in results:
        assert r["losses"] == pytest.approx(plain, rel=1e-5)
        mine = {k: v for k, v in r["state"].items() if k in want}
        assert mine and reference.max_rel_diff(mine, {k: want[k] for k in mine}) <= 1e-5
    assert results[0]["state"].keys() == results[1]["state"].keys()
    assert results[0]["state"].keys() != results[2]["state"].keys()


def _train_bf16(cfg: dict[str, Any], steps: int) -> list[float]:
    engine = longboat.initialize(_gpt(False), None, cfg)
    losses = [engine.train_step(b, lambda out, mb: _loss(out, mb[1])) for b in _batches(steps)]
    engine.close()
    return losses


def test_tensor_parallel_under_bf16_tracks_the_plain_autocast_loop(ranks):
    cfg = _config({"mesh": {"tp": 2}, "precision": {"dtype": "bf16"}})
    results = ranks(2, _train_bf16, cfg, STEPS)
    model = _gpt(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = []
    for x, y in _batches(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.split(4), y.split(4), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(xm)
            loss = _loss(logits.float(), ym)
            (loss / 2).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        plain.append(total / 2)
    # bf16 rounds differently when the sums are split across ranks: close, not equal
    assert results[0] == results[1]
    assert results[0] == pytest.approx(plain, rel=1e-2)


# -- checkpoints across layouts ------------------------------------------------------------------


def _phase(cfg: dict[str, Any], directory: str, first: int, steps: int) -> dict[str, Any]:
    """Load the latest checkpoint in ``directory`` if any, train batches ``first`` ..
    ``first + steps - 1``, save."""
    engine = longboat.initialize(_gpt(False), None, cfg)
    engine.load_checkpoint(directory, allow_missing=True)
    dp = engine.topology.data("dp")
    losses = [
        engine.train_step(
            tuple(t.chunk(dp.world_size)[dp.rank] for t in b), lambda out, mb: _loss(out, mb[1])
        )
        for b in _batches(first + steps)[first:]
    ]
    engine.save_checkpoint(directory)
    out = {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
        "step": engine.global_step,
    }
    engine.close()
    return out


def test_a_tensor_parallel_checkpoint_reshards_to_one_rank_and_to_zero3(ranks, tmp_path):
    import json

    from safetensors.torch import load_file

    from longboat.checkpoint.inspect import consolidate

    d = str(tmp_path)
    tp2 = ranks(2, _phase, _config({"mesh": {"tp": 2}}), d, 0, 2)
    manifest = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())
    assert manifest["version"] == 2
    qkv = manifest["tensors"]["blocks.0.attn.qkv.weight"]["model"]
    assert qkv["shape"] == [96, 32] and len(qkv["shards"]) == 2  # one per tp rank, 3 boxes each
    assert all(len(s["slices"]["boxes"]) == 3 for s in qkv["shards"])
    assert len(manifest["tensors"]["blocks.0.ln1.weight"]["model"]["shards"]) == 1  # once
    # consolidate writes the full weights a plain model loads
    plain_file = consolidate(tmp_path / "step-00000002", tmp_path / "whole.safetensors")
    whole = load_file(str(plain_file))
    assert reference.max_rel_diff(whole, tp2[0]["state"]) == 0.0
    one = ranks(1, _phase, _config({}), d, 2, 1)
    zero3 = ranks(2, _phase, _config({"strategy": "zero", "zero": {"stage": 3}}), d, 3, 1)
    assert zero3[0]["step"] == 4
    plain, model, opt, _ = _plain(4, False, BATCH // 2)
    losses = tp2[0]["losses"] + one[0]["losses"] + [sum(r["losses"][0] for r in zero3) / 2]
    assert losses == pytest.approx(plain, rel=1e-5)
    for r in zero3:
        assert reference.max_rel_diff(r["state"], model.state_dict()) <= 1e-5
    names = {id(p): n for n, p in model.named_parameters()}
    got = harness.assemble(zero3)
    for p, st in opt.state.items():
        name = names[id(p)]
        want = {name: st["momentum_buffer"]}
        assert reference.max_rel_diff({name: got[name]["momentum_buffer"]}, want) <= 1e-5
    # and back: the ZeRO-3 checkpoint loads at tp = 2 (the layouts are the checkpoint's concern)
    back = ranks(2, _phase, _config({"mesh": {"tp": 2}}), d, 4, 0)
    assert reference.max_rel_diff(back[0]["state"], zero3[0]["state"]) == 0.0


# -- a Hugging Face model ------------------------------------------------------------------------


def _hf(kind: str) -> nn.Module:
    """A small Hugging Face model built from a config (nothing downloaded), dropout off."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def _hf_loss(model_out: Any, y: torch.Tensor) -> torch.Tensor:
    return _loss(model_out.logits, y)


def _train_hf(kind: str, cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    engine = longboat.initialize(_hf(kind), None, cfg)
    losses = [engine.train_step(b, lambda out, mb: _hf_loss(out, mb[1])) for b in _batches(steps)]
    out = {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "local": {n: tuple(p.shape) for n, p in engine.model.named_parameters()},
    }
    engine.close()
    return out


HF_CASES = {
    "gpt2": ("gpt2", False, {"transformer.h.0.attn.c_attn.weight": (32, 48)}),  # Conv1D: [in, out]
    "gpt2-sequence": ("gpt2", True, {"transformer.h.0.attn.c_proj.weight": (16, 32)}),
    "llama": ("llama", False, {"model.layers.0.self_attn.k_proj.weight": (8, 32)}),  # 1 kv head
    "llama-sequence": ("llama", True, {"model.layers.0.mlp.down_proj.weight": (32, 32)}),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hugging_face_models_with_the_built_in_plans_equal_plain_pytorch(ranks, case):
    kind, sequence, held = HF_CASES[case]
    cfg = _config({"mesh": {"tp": 2}, "tensor_parallel": {"sequence_parallel": sequence}})
    results = ranks(2, _train_hf, kind, cfg, STEPS)
    model = _hf(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = []
    for x, y in _batches(STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.split(4), y.split(4), strict=True):
            loss = _hf_loss(model(xm), ym)
            (loss / 2).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        plain.append(total / 2)
    for r in results:
        assert r["losses"] == pytest.approx(plain, rel=1e-5)
        assert reference.max_rel_diff(r["state"], model.state_dict()) <= 1e-5
        assert {n: r["local"][n] for n in held} == held


# -- refusals ------------------------------------------------------------------------------------


def _initialize(cfg: dict[str, Any], heads: int = 4) -> None:
    longboat.initialize(_gpt(False, heads), None, cfg).close()


@pytest.mark.parametrize(
    ("extra", "heads", "words"),
    [
        ({}, 2, r"blocks.0.attn.n_heads = 2 does not divide among tp = 4"),
        ({"tensor_parallel": {"plan": {"blocks.*.mlp.gate": "colwise"}}}, 4, "name no module"),
        ({"tensor_parallel": {"plan": "llama"}}, 4, "name no module"),
        ({"tensor_parallel": {"plan": {"blocks.*.attn": "colwise"}}}, 4, "applies to nn.Linear"),
        ({"tensor_parallel": {"plan": "t5"}}, 4, "choose 'auto', one of gpt, gpt2, llama"),
    ],
    ids=["heads", "unmatched", "wrong-built-in", "not-linear", "unknown-plan"],
)
def test_plans_that_cannot_apply_are_refused_by_name(ranks, extra, heads, words):
    cfg = _config({"mesh": {"tp": 4}, **extra})
    with pytest.raises(RankFailure) as info:
        ranks(4, _initialize, cfg, heads)
    assert sorted(info.value.failures) == [0, 1, 2, 3]  # every rank, before any collective
    for text in info.value.failures.values():
        assert "ConfigError" in text and re.search(words, text), text


# -- the comm log ---------------------------------------------------------------------------------


def _logged(cfg: dict[str, Any], steps: int) -> dict[str, int]:
    engine = longboat.initialize(_gpt(False), None, cfg)
    for b in _batches(steps):
        engine.train_step(b, lambda out, mb: _loss(out, mb[1]))
    counts = {r["op"]: r["count"] for r in engine.tensor.comm.log_summary()}
    engine.close()
    return counts


def test_the_comm_log_counts_every_tensor_parallel_collective(ranks):
    cfg = _config({"mesh": {"tp": 2}, "comm": {"log": True}})
    counts = ranks(2, _logged, cfg, 2)
    # Per micro-batch (2 per step): the embedding's sum, per block q|k|v's and fc's input
    # gradients and proj's and mlp.proj's outputs (4 x 2 blocks), the head's input gradient: 10
    # all-reduces and the head's gather; per step, the gradient norm's sum over tp. Before any
    # of it, one broadcast per parameter and buffer: every tp rank starts from tp rank 0's.
    tensors = len([*_gpt(False).parameters(), *_gpt(False).buffers()])
    want = {"all_reduce": 2 * (2 * 10 + 1), "all_gather": 2 * 2, "broadcast": tensors}
    assert counts[0] == counts[1] == want


# -- longboat plan --------------------------------------------------------------------------------


def _held(cfg: dict[str, Any]) -> dict[str, int]:
    engine = longboat.initialize(_gpt(False), None, cfg)
    x, y = _batches(1)[0]
    engine.train_step((x[:4], y[:4]), lambda out, mb: _loss(out, mb[1]))
    measured = engine.memory_report().measured
    engine.close()
    return measured


def test_the_plan_of_a_tensor_parallel_rank_is_what_the_rank_holds(ranks):
    from longboat.config import load_config
    from longboat.plan.planner import make_plan
    from longboat.plan.render import render
    from longboat.plan.target import resolve

    dims = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": SEQ}
    extra = {"mesh": {"tp": 2}, "strategy": "replicate"}
    cfg = {**_config(extra), "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 1}}
    real = ranks(2, _held, cfg)
    base = load_config({"mesh": {"tp": 2}})
    plan = make_plan(
        resolve("gpt", {**dims, "tie_weights": False}), base, 2, 4, "sgd-momentum", ["replicate"]
    )
    (row,) = plan.strategies
    for category in ("parameters", "gradients", "optimizer_state"):
        assert row.model_state[category] == real[0][category], category
    # Per micro-batch of 4 x 8 tokens of width 32 (fp32, 4 KiB): 10 all-reduces of it (ring:
    # 2(n-1)/n = 1 x the buffer at 2 ranks), the head's gather of 4 x 8 x 64 logits (half sent);
    # the norm's one float is not clipped here (no clipping in the plan's config).
    act = 4 * SEQ * 32 * 4
    logits = 4 * SEQ * 64 * 4 // 2
    assert row.comm_bytes == {"tp all_reduce": 10 * act, "tp all_gather": logits}
    # per layer: each divided layer moves one activation's worth, the head also the logits
    layers = [
        f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    ]
    want = {"tok_emb": act, **dict.fromkeys(layers, act), "lm_head": act + logits}
    assert row.tp_layers == want
    text = render(plan)
    assert "blocks.*.attn.qkv 2 x 0.0 MiB" in text and "lm_head" in text
