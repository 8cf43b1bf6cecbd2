"""Mixed precision: the loss scaler's rules, overflow skips agreed by every rank, bf16/fp16 at two
ranks against the plain autocast loop of ``reference.py``, gradients communicated in bf16/fp16,
and the digits example.

Tolerances. bf16 keeps 8 significant bits (unit roundoff u = 2**-8 = 3.9e-3), fp16 11 bits
(u = 2**-11 = 4.9e-4). The plain loop runs each rank's micro-batch through the same
low-precision forward, so the products round alike; what differs is the order in which the fp32
gradients of the ranks are summed, and once a parameter differs in its last fp32 bit, a bf16 or
fp16 rounding of it can flip. The tests allow 4u relative to the largest parameter of a tensor.
A real mistake is far larger: a sum instead of a mean, a step that should have been skipped
(~0.4 here) or gradients left scaled (x256).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import harness
import pytest
import reference
import torch
import torch.nn.functional as F

import longboat
from longboat.comm.collectives import Collectives
from longboat.config import ConfigError, PrecisionConfig, load_config
from longboat.precision import LossScaleError, LossScaler, Precision

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
GLOBAL_BATCH = 16
U = {"bf16": 2.0**-8, "fp16": 2.0**-11}
TOL = {k: 4 * u for k, u in U.items()}

STRATEGIES = {
    "replicate": {"strategy": "replicate", "replicate": {"bucket_mb": 0.001}},
    "zero-1": {"strategy": "zero", "zero": {"stage": 1, "bucket_mb": 0.001}},
    "zero-2": {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.001}},
    "zero-3": {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear", "LayerNorm"]}},
}


# -- the loss scaler alone ---------------------------------------------------------------------


def test_hysteresis_delays_halving_and_is_not_refilled_by_halving():
    s = LossScaler(2.0**16, window=1000, hysteresis=2)
    s.update(True, 1)
    assert s.scale == 2.0**16, "the first overflow only spends hysteresis"
    s.update(True, 2)
    assert s.scale == 2.0**15
    s.update(False, 3)
    s.update(True, 4)
    assert s.scale == 2.0**14, "hysteresis is refilled only when the scale grows"


def test_scale_doubles_after_a_window_of_good_steps():
    s = LossScaler(8.0, window=3, hysteresis=2)
    for step in (1, 2):
        s.update(False, step)
    assert s.scale == 8.0
    s.update(False, 3)
    assert s.scale == 16.0
    s.update(False, 4)
    s.update(True, 5)  # spends hysteresis and restarts the window
    assert s.scale == 16.0
    s.update(False, 6)
    s.update(False, 7)
    assert s.scale == 16.0
    s.update(False, 8)
    assert s.scale == 32.0 and s.hysteresis_left == 2


def _deepspeed_rules(
    overflows: list[bool], scale: float, window: int, hysteresis: int, min_scale: float
) -> list[float | str]:
    """DeepSpeed's dynamic loss scale restated with its own bookkeeping (iteration counter and
    the iteration of the last overflow), as an independent check of LossScaler's counters."""
    out: list[float | str] = []
    last_overflow, shift = -1, hysteresis
    for it, overflow in enumerate(overflows):
        if overflow:
            if shift == 1:
                if scale == min_scale:
                    out.append("error")
                    return out
                scale = max(scale / 2, min_scale)
            else:
                shift -= 1
            last_overflow = it
        elif (it - last_overflow) % window == 0:
            scale *= 2
            shift = hysteresis
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis", [1, 2, 3])
def test_scaler_follows_deepspeed_rules_on_random_sequences(hysteresis):
    rng = random.Random(hysteresis)
    for trial in range(200):
        overflows = [rng.random() < 0.35 for _ in range(60)]
        expected = _deepspeed_rules(overflows, 2.0**6, 3, hysteresis, 1.0)
        s, got = LossScaler(2.0**6, window=3, hysteresis=hysteresis, min_scale=1.0), []
        for step, overflow in enumerate(overflows, 1):
            try:
                s.update(overflow, step)
            except LossScaleError:
                got.append("error")
                break
            got.append(s.scale)
        assert got == expected, f"trial {trial}: {overflows}"


def test_overflow_at_min_scale_is_a_clear_error():
    s = LossScaler(3.0, window=1000, hysteresis=1, min_scale=2.0)
    s.update(True, 6)
    assert s.scale == 2.0, "halving stops at min_loss_scale"
    with pytest.raises(LossScaleError) as e:
        s.update(True, 7)
    for words in ("step 7", "minimum 2", "precision.min_loss_scale", "bf16", "learning rate"):
        assert words in str(e.value), str(e.value)


def test_static_scale_never_changes_and_never_raises():
    s = LossScaler.from_config(PrecisionConfig(dtype="fp16", loss_scale=128.0))
    assert not s.dynamic
    for step in range(1, 3000):
        s.update(step % 3 == 0, step)
    assert s.scale == 128.0


def test_scaler_state_is_plain_numbers_and_reloads():
    cfg = PrecisionConfig(
        dtype="fp16", initial_scale_power=10, loss_scale_window=5, hysteresis=3, min_loss_scale=0.25
    )
    s = LossScaler.from_config(cfg)
    assert (s.scale, s.window, s.hysteresis, s.min_scale) == (1024.0, 5, 3, 0.25)
    for step, overflow in enumerate([True, True, True, False, False], 1):
        s.update(overflow, step)
    state = json.loads(json.dumps(s.state_dict()))
    t = LossScaler.from_config(cfg)
    t.load_state_dict(state)
    assert (
        t.state_dict() == s.state_dict() == {"scale": 512.0, "hysteresis_left": 1, "good_steps": 2}
    )


def test_unscale_and_check_in_a_world_of_one():
    p = Precision(PrecisionConfig(dtype="fp16", initial_scale_power=4), "cpu")
    grads = [torch.full((3,), 16.0), torch.full((2, 2), -8.0)]
    assert p.unscale_and_check(grads, Collectives()) is False
    assert torch.equal(grads[0], torch.ones(3)) and torch.equal(grads[1], -0.5 * torch.ones(2, 2))
    grads[1][0, 1] = float("nan")
    assert p.unscale_and_check(grads, Collectives()) is True
    bf16 = Precision(PrecisionConfig(dtype="bf16"), "cpu")
    g = [torch.full((3,), float("inf"))]
    assert bf16.unscale_and_check(g, Collectives()) is False, "bf16 neither scales nor checks"
    assert bf16.scale(torch.tensor(2.0)).item() == 2.0


def test_fp16_keys_need_fp16():
    with pytest.raises(ConfigError, match=r"precision\.hysteresis"):
        load_config({"precision": {"dtype": "bf16", "hysteresis": 3}})


# -- training: two ranks against the plain loop ------------------------------------------------


def _recipe(dtype: str, clip: float = 0.0) -> reference.Recipe:
    # SGD with momentum and a schedule; fp16 at a scale of 2**8, small enough that TinyNet never
    # overflows by itself, and a window of 4 so that 4 good steps after an overflow double it.
    return reference.Recipe(
        model="tiny",
        optimizer="sgd",
        clip=clip,
        scheduler=True,
        precision=dtype,
        loss_scale=2.0**8,
        loss_scale_window=4,
    )


@pytest.mark.parametrize("how", ["loss", "grad"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_overflow_on_one_rank_skips_the_step_on_every_rank(ranks, strategy, how):
    """Rank 1 meets an overflow at step 4: ``how='loss'`` multiplies its loss by inf before
    backward; ``how='grad'`` puts an inf into one of the gradients it owns *after*
    communication, so that only this rank can see it and the ranks can agree only through the
    all-reduced flag. Every rank skips step 4 (no optimizer step, no scheduler step), as the
    plain loop does with torch's GradScaler, and the scale halves, then doubles after 4 good
    steps."""
    recipe = _recipe("fp16")
    results, plain = harness.run_and_compare(
        ranks,
        2,
        STRATEGIES[strategy],
        recipe,
        STEPS,
        1,
        GLOBAL_BATCH,
        TOL["fp16"],
        poison=(4, 1),
        poison_how=how,
    )
    assert plain.skipped == [4]
    for r, res in enumerate(results):
        assert res["scales"] == [256.0] * 3 + [128.0] * 4 + [256.0] * 3, f"rank {r}"
        for k, v in res["state"].items():
            assert torch.equal(v, results[0]["state"][k]), f"rank {r} diverged from rank 0 at {k}"
    # The comparison can tell: not skipping step 4 ends far away.
    unskipped = reference.plain_train(
        recipe, harness.data_for(recipe, GLOBAL_BATCH * STEPS), harness.order_of(results)
    )
    assert unskipped.skipped == []
    assert reference.max_rel_diff(unskipped.state, plain.state) > 50 * TOL["fp16"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_ranks_equal_plain_autocast(ranks, strategy, dtype):
    """Clipping at 0.5 must see unscaled gradients. Against the plain loop in the same dtype the
    difference stays within 4 units of roundoff; against fp32 too (one more rounding path),
    which catches what both could get wrong together."""
    recipe = _recipe(dtype, clip=0.5)
    results, _ = harness.run_and_compare(
        ranks, 2, STRATEGIES[strategy], recipe, STEPS, 1, GLOBAL_BATCH, TOL[dtype]
    )
    fp32 = reference.plain_train(
        _recipe("fp32", clip=0.5),
        harness.data_for(recipe, GLOBAL_BATCH * STEPS),
        harness.order_of(results),
    )
    diff = reference.max_rel_diff(results[0]["state"], fp32.state)
    assert diff < TOL[dtype], f"{diff:.3g} vs fp32"
    init = reference.Recipe().build()[0].state_dict()
    assert reference.max_rel_diff(fp32.state, init) > 1e-2


def _dtypes(dtype: str) -> dict:
    recipe = _recipe(dtype)
    model, opt, sched = recipe.build()
    seen: set[torch.dtype] = set()
    model.mid.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    cfg = harness.config({"strategy": "replicate"}, recipe, GLOBAL_BATCH, GLOBAL_BATCH // 2)
    engine = longboat.initialize(model, opt, cfg, scheduler=sched)
    grads: set[torch.dtype] = set()  # what the optimizer sees
    opt.register_step_pre_hook(
        lambda o, _a, _k: grads.update(
            p.grad.dtype for g in o.param_groups for p in g["params"] if p.grad is not None
        )
    )
    x, y = reference.dataset(8)[:]
    out = engine(x)
    engine.backward(F.cross_entropy(out, y))
    engine.step()
    res = {
        "inner": seen,
        "out": out.dtype,
        "params": {p.dtype for p in model.parameters()},
        "grads": grads,
    }
    engine.close()
    return res


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_forward_in_low_precision_with_fp32_master_weights(ranks, dtype):
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for r, res in enumerate(ranks(2, _dtypes, dtype)):
        assert res["inner"] == {low}, f"rank {r}: the forward did not run in {dtype}"
        assert res["out"] == torch.float32, "outputs come back in fp32"
        assert res["params"] == res["grads"] == {torch.float32}, "master weights and gradients"
    assert ranks(2, _dtypes, "fp32")[0]["inner"] == {torch.float32}


def test_fp16_scale_backs_off_from_real_overflows(ranks):
    """Starting at 2**24, fp16 gradients overflow by themselves until the scale has halved
    enough; those steps are skipped, and training then goes on with finite weights."""
    recipe = dataclasses.replace(_recipe("fp16"), loss_scale=2.0**24, loss_scale_window=1000)
    cfg = harness.config({"strategy": "single"}, recipe, GLOBAL_BATCH, GLOBAL_BATCH)
    (res,) = ranks(1, harness.train, recipe, cfg, STEPS)
    skipped, scales = res["skipped"], [2.0**24, *res["scales"]]
    assert skipped[0] == 1 and len(skipped) < STEPS, skipped
    for step in range(1, STEPS + 1):  # with hysteresis 1 each overflow halves the scale at once
        assert scales[step] == scales[step - 1] / (2 if step in skipped else 1), scales
    assert all(torch.isfinite(v).all() for v in res["state"].values())


# -- gradients travelling in bf16/fp16 (replicate) ---------------------------------------------


def _train_counting_bytes(cfg: dict) -> dict:
    sent: list[int] = []
    real = Collectives.all_reduce

    def counting(self, tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real(self, tensor, *args, **kwargs)

    Collectives.all_reduce = counting
    try:
        recipe = reference.Recipe(model="tiny", optimizer="sgd")
        model, opt, _ = recipe.build()
        engine = longboat.initialize(
            model,
            opt,
            harness.config(
                {"strategy": "replicate", "replicate": {"bucket_mb": 0.001}},
                recipe,
                GLOBAL_BATCH,
                GLOBAL_BATCH // 2,
                **cfg,
            ),
        )
        grads: set[torch.dtype] = set()  # what the optimizer sees
        opt.register_step_pre_hook(
            lambda o, _a, _k: grads.update(
                p.grad.dtype for g in o.param_groups for p in g["params"] if p.grad is not None
            )
        )
        ids = []
        for sample_ids, *batch in engine.loader(harness.data_for(recipe, GLOBAL_BATCH * STEPS)):
            engine.backward(reference.forward_loss(engine, batch))
            ids.append([sample_ids.tolist()])  # one micro-batch per step
            engine.step()
        assert engine.global_step == STEPS
        buckets = {b.buffer.dtype for b in engine.strategy.plan.buckets}
        state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
        engine.close()
    finally:
        Collectives.all_reduce = real
    return {"state": state, "bytes": sum(sent), "buckets": buckets, "grads": grads, "ids": ids}


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_gradients_travel_in_the_communication_dtype(ranks, wire):
    wire_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[wire]
    low = ranks(2, _train_counting_bytes, {"precision": {"communication_data_type": wire}})
    full = ranks(2, _train_counting_bytes, {})
    recipe = reference.Recipe(model="tiny", optimizer="sgd")
    ref = reference.plain_train(
        recipe, harness.data_for(recipe, GLOBAL_BATCH * STEPS), harness.order_of(low)
    )
    assert full[0]["buckets"] == {torch.float32}
    for r, res in enumerate(low):
        assert res["buckets"] == {wire_dtype}, f"rank {r}: buckets {res['buckets']}"
        assert res["grads"] == {torch.float32}, "gradients come back into fp32"
        assert 2 * res["bytes"] == full[r]["bytes"] > 0, "half the bytes on the wire"
        for k, v in res["state"].items():
            assert torch.equal(v, low[0]["state"][k]), f"rank {r} diverged at {k}"
    # Gradients are rounded once to the wire dtype and once more by the sum of two ranks.
    diff = reference.max_rel_diff(low[0]["state"], ref.state)
    assert diff < TOL[wire], f"{diff:.3g} vs fp32 in one process"
    assert reference.max_rel_diff(full[0]["state"], ref.state) < 1e-5


# -- the digits example converges -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_digits_converges_in_low_precision(ranks, tmp_path, dtype):
    config = harness.digits_config(extra=f'\n[precision]\ndtype = "{dtype}"\n')
    assert config.count("[precision]") == 1
    accuracy, out = harness.digits_accuracy(ranks, tmp_path, f"digits_{dtype}", config)
    assert f"precision {dtype}: forward under torch.autocast" in out
    assert accuracy >= 0.95, out[-2000:]
