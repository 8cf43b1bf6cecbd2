"""Parameters in a lower precision under ZeRO stages 1-3 (``precision.param_dtype``, FSDP2's
``MixedPrecisionPolicy``, DeepSpeed's bf16; [Note: parameter dtype] in
longboat/strategies/zero/gather.py): against the plain autocast loop of ``reference.py`` at 1, 2
and 4 ranks, with half the all-gather bytes, bf16 weights in the forward and fp32 masters in the
optimizer, the state dict, checkpoints and the model handed back.

The plain loop imports nothing from longboat: its parameters are the fp32 masters, its optimizer
steps them, and autocast casts them to bf16 for every matmul, which is what the strategy's bf16
copies of the masters compute with.

Tolerance. The plain loop computes under bf16 autocast from fp32 parameters: autocast rounds each
weight to bf16 for the matmuls, as gathering in bf16 does, so the forwards agree. What differs is
the backward: here each weight's gradient is itself a bf16 tensor (rounded once, u = 2**-8), and
reduced in bf16 across ranks (rounded once more per sum), where autocast hands fp32 parameters
fp32 gradients. Those roundings are unbiased and a step moves a weight by lr x gradient, so after
10 steps the parameters stay within a few u of the plain run's, relative to the largest element
of each tensor: 8u is allowed. A real mistake is far larger: fp32 weights in the forward would not
halve the bytes, a gradient left scaled or summed instead of averaged would be off by x2 at least.
"""

from __future__ import annotations

from typing import Any

import harness
import pytest
import reference
import torch

import longboat
from longboat.comm.collectives import Collectives

STEPS = 10
GLOBAL_BATCH = 16
U = 2.0**-8
TOL = 8 * U
ZERO3 = {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear"]}}
#: Stages 1-2 with small buckets: several units, whose sizes divide no world size
ZERO = {
    1: {"strategy": "zero", "zero": {"stage": 1, "bucket_mb": 0.0005}},
    2: {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.0005}},
    3: ZERO3,
}
LOW = {"dtype": "bf16", "param_dtype": "bf16"}


def _recipe(model: str = "tiny") -> reference.Recipe:
    return reference.Recipe(model=model, optimizer="adamw", clip=0.5, precision="bf16")


@pytest.mark.parametrize(
    ("world", "accum", "model"),
    [(1, 2, "tiny"), (2, 1, "tiny"), (2, 2, "zoo"), (4, 1, "tiny")],
)
def test_bf16_parameters_equal_plain_autocast(ranks: Any, world: int, accum: int, model: str):
    """Losses at every micro-batch, parameters, buffers and optimizer state within 8u; the zoo
    model has conditionally used, never-used, frozen and tied parameters, and batch norm and
    an LSTM, whose parameters keep fp32 (``KEEP_OWN_DTYPE``)."""
    recipe = _recipe(model)
    strategy = harness.ZOO_STRATEGIES["zero3"] if model == "zoo" else ZERO3
    results, plain = harness.run_and_compare(
        ranks, world, strategy, recipe, STEPS, accum, GLOBAL_BATCH, TOL, precision=LOW
    )
    for r, res in enumerate(results):
        assert {v.dtype for v in res["state"].values() if v.is_floating_point()} == {
            torch.float32
        }, f"rank {r}: the state dict holds the fp32 masters"
    init = dict(recipe.build()[0].named_parameters())
    moved = reference.max_rel_diff({k: plain.state[k] for k in init}, init)
    assert moved > 10 * TOL, "training moved the weights far more than the tolerance"


@pytest.mark.parametrize(
    ("stage", "world", "accum", "optimizer"),
    [
        (1, 1, 2, "adamw"),
        (2, 1, 1, "sgd"),
        (1, 2, 2, "sgd"),
        (2, 2, 2, "adamw"),
        (1, 4, 1, "adamw"),
        (2, 4, 1, "sgd"),
    ],
)
def test_bf16_parameters_at_stages_1_2_equal_plain_autocast(
    ranks: Any, stage: int, world: int, accum: int, optimizer: str
):
    """Stages 1-2 on the zoo model (frozen, tied, never-used and conditionally used parameters;
    batch norm and an LSTM keep fp32): losses at every micro-batch, the fp32 masters, buffers
    and optimizer state within 8u of the plain loop, for the reason above: gradients here are
    bf16 tensors reduced in bf16, where autocast's are fp32. The clip (0.1) is below the
    gradients' norm (about 0.36 at the first step), and SGD's update scales with it where
    Adam's would hide a wrong norm."""
    recipe = reference.Recipe(model="zoo", optimizer=optimizer, clip=0.1, precision="bf16")
    results, plain = harness.run_and_compare(
        ranks,
        world,
        harness.ZOO_STRATEGIES[f"zero{stage}"],
        recipe,
        STEPS,
        accum,
        GLOBAL_BATCH,
        TOL,
        precision=LOW,
    )
    for r, res in enumerate(results):
        assert {v.dtype for v in res["state"].values() if v.is_floating_point()} == {
            torch.float32
        }, f"rank {r}: the state dict holds the fp32 masters"
    init = dict(recipe.build()[0].named_parameters())
    moved = reference.max_rel_diff({k: plain.state[k] for k in init}, init)
    assert moved > 10 * TOL, "training moved the weights far more than the tolerance"


def _gathered_bytes(precision: dict[str, Any], stage: int = 3) -> dict[str, Any]:
    """Two steps of ZeRO (stage 3 unless told) on TinyNet counting the bytes every all-gather
    and reduce-scatter sends, the weights' dtype inside the forward, and what the optimizer
    steps."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    real = {name: getattr(Collectives, name) for name in counts}

    def counting(name: str) -> Any:
        def call(self: Collectives, output: torch.Tensor, input: torch.Tensor, *a: Any, **k: Any):
            counts[name] += input.numel() * input.element_size()
            return real[name](self, output, input, *a, **k)

        return call

    for name in counts:
        setattr(Collectives, name, counting(name))
    try:
        recipe = _recipe()
        model, opt, _ = recipe.build()
        inside: set[torch.dtype] = set()
        model.mid.register_forward_pre_hook(lambda m, _a: inside.add(m.weight.dtype))
        stepped: set[torch.dtype] = set()
        opt.register_step_pre_hook(
            lambda o, _a, _k: stepped.update(
                t.dtype
                for g in o.param_groups
                for p in g["params"]
                for t in (p, p.grad)
                if t is not None
            )
        )
        micro = GLOBAL_BATCH // 2
        cfg = harness.config(ZERO[stage], recipe, GLOBAL_BATCH, micro, precision=precision)
        engine = longboat.initialize(model, opt, cfg)
        for _ids, *batch in engine.loader(harness.data_for(recipe, GLOBAL_BATCH * 2)):
            engine.backward(reference.forward_loss(engine, batch))
            engine.step()
        trained = dict(counts)  # close() gathers the masters, in fp32 either way
        report = engine.memory_report()
        dtypes = {v.dtype for st in opt.state.values() for v in st.values() if torch.is_tensor(v)}
        engine.close()
        handed_back = {p.dtype for p in model.parameters()}
    finally:
        for name, fn in real.items():
            setattr(Collectives, name, fn)
    return {
        **trained,
        "inside": inside,
        "stepped": stepped,
        "state_dtypes": dtypes,
        "handed_back": handed_back,
        "parameter_bytes": (report.measured["parameters"], report.expected["parameters"]),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gathers_move_half_the_bytes_and_the_optimizer_keeps_fp32_masters(ranks: Any, stage: int):
    """Stage 3's gathers before use, and stages 1-2's all-gather of the updated shards after
    each step, move bf16; the reduce-scatters too (FSDP2's default: reduce in param_dtype)."""
    full = ranks(2, _gathered_bytes, {"dtype": "bf16"}, stage)
    low = ranks(2, _gathered_bytes, LOW, stage)
    for r in range(2):
        assert full[r]["inside"] == {torch.float32} and low[r]["inside"] == {torch.bfloat16}
        assert 2 * low[r]["all_gather"] == full[r]["all_gather"] > 0, (low[r], full[r])
        # Gradients are reduced in their own dtype, param_dtype's, unless reduce_dtype says.
        assert 2 * low[r]["reduce_scatter"] == full[r]["reduce_scatter"] > 0
        assert low[r]["stepped"] == {torch.float32}, "the optimizer steps fp32 shards"
        assert low[r]["state_dtypes"] == {torch.float32}
        assert low[r]["handed_back"] == {torch.float32}, "close() hands back the masters"
    # The memory report's formula counts stages 1-2's bf16 copy beside the fp32 shard: at one
    # rank 2 + 4 bytes a parameter (at two, 2 + 4/2 happens to equal fp32's 4).
    for res in [*low, *ranks(1, _gathered_bytes, LOW, stage)]:
        measured, expected = res["parameter_bytes"]
        assert abs(measured - expected) <= 0.05 * expected, res["parameter_bytes"]


@pytest.mark.parametrize("stage", [1, 3])
def test_reduce_dtype_fp32_reduces_bf16_gradients_in_fp32(ranks: Any, stage: int):
    low = ranks(2, _gathered_bytes, LOW, stage)
    wide = ranks(2, _gathered_bytes, {**LOW, "reduce_dtype": "fp32"}, stage)
    for r in range(2):
        assert wide[r]["all_gather"] == low[r]["all_gather"]
        assert wide[r]["reduce_scatter"] == 2 * low[r]["reduce_scatter"] > 0


def _loaded(cfg: dict[str, Any], directory: str) -> dict[str, Any]:
    """The zoo model loaded from ``directory`` under ``cfg``: its state dict, optimizer pieces
    and what the forward computes from (each trained parameter as the module holds it)."""
    model, opt, _ = reference.Recipe(model="zoo", optimizer="adamw").build()
    engine = longboat.initialize(model, opt, cfg)
    engine.load_checkpoint(directory, "saved")
    out = {
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
        "live": {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
    }
    engine.close()
    return out


@pytest.mark.parametrize(
    ("saved_at", "loaded_at"), [((1, 2), (2, 4)), ((2, 4), (1, 1)), ((3, 2), (1, 4))]
)
def test_checkpoints_keep_the_fp32_masters_and_reshard(
    ranks: Any, tmp_path: Any, saved_at: tuple[int, int], loaded_at: tuple[int, int]
):
    """Saved at one stage and world size (stage 3's too), loaded at stage 1 or 2 at another:
    every rank's state dict and the
    assembled optimizer state equal the saved ones exactly, the masters are fp32 values a bf16
    copy could not hold, and the forward computes from the masters cast to bf16."""
    (stage_a, world_a), (stage_b, world_b) = saved_at, loaded_at

    def cfg(stage: int, world: int) -> dict[str, Any]:
        batch = {"train_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // world}
        return {**harness.ZOO_STRATEGIES[f"zero{stage}"], "batch": batch, "precision": LOW}

    ckpt = str(tmp_path)
    saved = ranks(world_a, harness.save_or_load, cfg(stage_a, world_a), ckpt, 3)
    loaded = ranks(world_b, _loaded, cfg(stage_b, world_b), ckpt)
    want = saved[0]["state"]
    trained = [k for k in loaded[0]["live"] if k in want]
    assert trained and all(want[k].dtype == torch.float32 for k in trained)
    assert any(not torch.equal(want[k].bfloat16().float(), want[k]) for k in trained), (
        "the checkpoint holds bf16-rounded values, not the fp32 masters"
    )
    for r, res in enumerate(loaded):
        assert res["state"].keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(res["state"][k], v), f"rank {r}: {k} differs after loading"
        for k in trained:
            live = res["live"][k]
            assert live.dtype in (torch.bfloat16, torch.float32), k
            assert torch.equal(live, want[k].to(live.dtype)), f"rank {r}: {k} computes from"
        assert {res["live"][k].dtype for k in trained} == {torch.bfloat16, torch.float32}
    got, expected = harness.assemble(loaded), harness.assemble(saved)
    assert got.keys() == expected.keys()
    for name, st in expected.items():
        for key, v in st.items():
            same = torch.equal(got[name][key], v) if torch.is_tensor(v) else got[name][key] == v
            assert same, f"optimizer state {name}.{key} differs after loading"
