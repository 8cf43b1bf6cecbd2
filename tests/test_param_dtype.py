"""Parameters in a lower precision under ZeRO-3 (``precision.param_dtype``, FSDP2's
``MixedPrecisionPolicy``; [Note: parameter dtype] in longboat/strategies/zero/gather.py): against
the plain autocast loop of ``reference.py`` at 1, 2 and 4 ranks, with half the all-gather bytes,
bf16 weights in the forward and fp32 masters in the optimizer, the state dict and the model
handed back.

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


def _gathered_bytes(precision: dict[str, Any]) -> dict[str, Any]:
    """Two steps of ZeRO-3 on TinyNet counting the bytes every all-gather and reduce-scatter
    sends, the weights' dtype inside the forward, and what the optimizer steps."""
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
        cfg = harness.config(ZERO3, recipe, GLOBAL_BATCH, GLOBAL_BATCH // 2, precision=precision)
        engine = longboat.initialize(model, opt, cfg)
        for _ids, *batch in engine.loader(harness.data_for(recipe, GLOBAL_BATCH * 2)):
            engine.backward(reference.forward_loss(engine, batch))
            engine.step()
        trained = dict(counts)  # close() gathers the masters, in fp32 either way
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
    }


def test_gathers_move_half_the_bytes_and_the_optimizer_keeps_fp32_masters(ranks: Any):
    full = ranks(2, _gathered_bytes, {"dtype": "bf16"})
    low = ranks(2, _gathered_bytes, LOW)
    for r in range(2):
        assert full[r]["inside"] == {torch.float32} and low[r]["inside"] == {torch.bfloat16}
        assert 2 * low[r]["all_gather"] == full[r]["all_gather"] > 0, (low[r], full[r])
        # Gradients are reduced in their own dtype, param_dtype's, unless reduce_dtype says.
        assert 2 * low[r]["reduce_scatter"] == full[r]["reduce_scatter"] > 0
        assert low[r]["stepped"] == {torch.float32}, "the optimizer steps fp32 shards"
        assert low[r]["state_dtypes"] == {torch.float32}
        assert low[r]["handed_back"] == {torch.float32}, "close() hands back the masters"


def test_reduce_dtype_fp32_reduces_bf16_gradients_in_fp32(ranks: Any):
    low = ranks(2, _gathered_bytes, LOW)
    wide = ranks(2, _gathered_bytes, {**LOW, "reduce_dtype": "fp32"})
    for r in range(2):
        assert wide[r]["all_gather"] == low[r]["all_gather"]
        assert wide[r]["reduce_scatter"] == 2 * low[r]["reduce_scatter"] > 0
