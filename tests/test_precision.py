"""Mixed precision: the loss scaler's rules, overflow skips agreed by every rank, bf16/fp16 at two
ranks against a single process, gradients communicated in bf16/fp16, and the digits example.

Tolerances. bf16 keeps 8 significant bits (unit roundoff u = 2**-8 = 3.9e-3), fp16 11 bits
(u = 2**-11 = 4.9e-4). Two ranks with 8 samples each and one process with 16 run the same
samples, but the low-precision matrix products that produce each gradient sum over 8 rows instead
of 16 and round at different places, so every step's gradient differs by about u relative. Ten
SGD steps with momentum keep that at a few u relative to the largest parameter (measured: 1.7u
bf16, 1.3u fp16); the tests allow 4u. A real mistake is far larger: a sum instead of a mean,
a step that should have been skipped (~0.4 here) or gradients left scaled (x256).
"""

from __future__ import annotations

import functools
import json
import random
import re
import subprocess
import sys
from pathlib import Path

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

# fp16 with a scale of 2**8, small enough that TinyNet never overflows by itself; hysteresis 1
# and a window of 4 so that one overflow halves the scale and 4 good steps double it again.
FP16 = {"dtype": "fp16", "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 4}
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


def _deepspeed_rules(overflows: list[bool], scale: float, window: int, hysteresis: int,
                     min_scale: float) -> list[float | str]:
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
    cfg = PrecisionConfig(dtype="fp16", initial_scale_power=10, loss_scale_window=5,
                          hysteresis=3, min_loss_scale=0.25)
    s = LossScaler.from_config(cfg)
    assert (s.scale, s.window, s.hysteresis, s.min_scale) == (1024.0, 5, 3, 0.25)
    for step, overflow in enumerate([True, True, True, False, False], 1):
        s.update(overflow, step)
    state = json.loads(json.dumps(s.state_dict()))
    t = LossScaler.from_config(cfg)
    t.load_state_dict(state)
    assert t.state_dict() == s.state_dict() == {"scale": 512.0, "hysteresis_left": 1,
                                                "good_steps": 2}


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


# -- training: one process and two ranks -------------------------------------------------------


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = reference.TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))


def _train(cfg: dict, inject_step: int | None = None, inject_rank: int = 0,
           how: str = "grad", steps: int = STEPS) -> dict:
    """Train TinyNet with SGD and a scheduler for ``steps`` optimizer steps.

    Optionally ``inject_rank`` meets an overflow at optimizer step ``inject_step``: ``how='loss'``
    multiplies its loss by inf before backward; ``how='grad'`` puts an inf into one of the
    gradients it owns *after* communication, so that only this rank can see it and the ranks
    can agree only through the all-reduced flag."""
    model, opt, sched = _model()
    seen: list[torch.dtype] = []
    model.mid.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    engine = longboat.initialize(model, opt, {
        "log": {"progress": False, "level": "WARNING"},
        "batch": {"train_batch_size": GLOBAL_BATCH}, **cfg}, scheduler=sched)
    poison = inject_step is not None and engine.comm.rank == inject_rank
    if poison and how == "grad":
        own = engine.strategy.local_gradients

        def local_gradients() -> list[torch.Tensor]:
            grads = own()
            if engine.global_step + 1 == inject_step:
                grads[0].view(-1)[0] = float("inf")
            return grads

        engine.strategy.local_gradients = local_gradients
    loader = engine.loader(reference.dataset(GLOBAL_BATCH * steps))
    skipped, scales, out_dtypes = [], [], set()
    while engine.global_step < steps:
        for x, y in loader:
            out = engine(x)
            out_dtypes.add(out.dtype)
            loss = F.cross_entropy(out, y)
            if poison and how == "loss" and engine.global_step + 1 == inject_step:
                loss = loss * float("inf")
            engine.backward(loss)
            before = engine.skipped_steps
            if engine.step():
                scales.append(engine.precision.loss_scale)
                if engine.skipped_steps > before:
                    skipped.append(engine.global_step)
            if engine.global_step == steps:
                break
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    engine.close()
    return {"state": state, "skipped": skipped, "scales": scales, "sched": sched.last_epoch,
            "inner_dtypes": set(seen), "out_dtypes": out_dtypes}


@functools.cache
def _single(dtype: str, clip: float = 0.0, inject_step: int | None = None, how: str = "grad"
            ) -> dict:
    """A single-process reference run (cached: it is deterministic and used by many tests)."""
    prec = {"fp32": {}, "bf16": {"dtype": "bf16"}, "fp16": FP16}[dtype]
    return _train({"strategy": "single", "gradient_clipping": clip, "precision": prec},
                  inject_step=inject_step, how=how)


@pytest.mark.parametrize("how", ["loss", "grad"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_overflow_on_one_rank_skips_the_step_on_every_rank(ranks, strategy, how):
    results = ranks(2, _train, {**STRATEGIES[strategy], "precision": FP16},
                    inject_step=4, inject_rank=1, how=how)
    ref, unskipped = _single("fp16", inject_step=4, how=how), _single("fp16")
    assert ref["skipped"] == [4] and unskipped["skipped"] == []
    assert ref["sched"] == STEPS - 1, "the scheduler does not step on a skipped step"
    # 256 for steps 1-3, halved by the overflow at 4, doubled after 4 good steps (5-8).
    assert ref["scales"] == [256.0] * 3 + [128.0] * 4 + [256.0] * 3
    for r, res in enumerate(results):
        assert res["skipped"] == ref["skipped"], f"rank {r} skipped {res['skipped']}"
        assert res["scales"] == ref["scales"], f"rank {r} scales {res['scales']}"
        assert res["sched"] == STEPS - 1
        for k, v in res["state"].items():
            assert torch.equal(v, results[0]["state"][k]), f"rank {r} diverged from rank 0 at {k}"
    diff = reference.max_rel_diff(results[0]["state"], ref["state"])
    assert diff < TOL["fp16"], f"{diff:.3g} vs a single process skipping the same step"
    # The comparison can tell: not skipping step 4 ends far away.
    assert reference.max_rel_diff(unskipped["state"], ref["state"]) > 50 * TOL["fp16"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_ranks_match_one_process_in_low_precision(ranks, strategy, dtype):
    prec = FP16 if dtype == "fp16" else {"dtype": "bf16"}
    clip = 0.5  # clipping must see unscaled gradients
    results = ranks(2, _train, {**STRATEGIES[strategy], "gradient_clipping": clip,
                                "precision": prec})
    ref, fp32 = _single(dtype, clip), _single("fp32", clip)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert fp32["inner_dtypes"] == {torch.float32}
    for r, res in enumerate(results):
        assert res["inner_dtypes"] == {low}, f"rank {r}: the forward did not run in {dtype}"
        assert res["out_dtypes"] == {torch.float32}, "outputs come back in fp32"
        assert all(v.dtype == torch.float32 for v in res["state"].values()), "master weights"
        assert res["skipped"] == []
        diff = reference.max_rel_diff(res["state"], ref["state"])
        assert diff < TOL[dtype], f"rank {r}: {diff:.3g} vs a single {dtype} process"
    # Against fp32 the same bound holds (one more rounding path): this catches what both sides
    # could get wrong together, such as clipping gradients that are still scaled.
    diff = reference.max_rel_diff(results[0]["state"], fp32["state"])
    assert diff < TOL[dtype], f"{diff:.3g} vs fp32"
    torch.manual_seed(0)
    assert reference.max_rel_diff(fp32["state"], reference.TinyNet().state_dict()) > 1e-2


def test_fp16_scale_backs_off_from_real_overflows():
    """Starting at 2**24, fp16 gradients overflow by themselves until the scale has halved
    enough; those steps are skipped, and training then goes on with finite weights."""
    res = _train({"strategy": "single", "precision": {
        "dtype": "fp16", "initial_scale_power": 24, "hysteresis": 1}})
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
        model, opt, sched = _model()
        engine = longboat.initialize(model, opt, {
            "log": {"progress": False, "level": "WARNING"}, "strategy": "replicate",
            "batch": {"train_batch_size": GLOBAL_BATCH}, "replicate": {"bucket_mb": 0.001},
            **cfg}, scheduler=sched)
        grads: set[torch.dtype] = set()  # what the optimizer sees
        opt.register_step_pre_hook(lambda o, _a, _k: grads.update(
            p.grad.dtype for g in o.param_groups for p in g["params"] if p.grad is not None))
        done = 0
        for x, y in engine.loader(reference.dataset(GLOBAL_BATCH * STEPS)):
            engine.backward(F.cross_entropy(engine(x), y))
            done += engine.step()
        assert done == STEPS
        buckets = {b.buffer.dtype for b in engine.strategy.plan.buckets}
        state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
        engine.close()
    finally:
        Collectives.all_reduce = real
    return {"state": state, "bytes": sum(sent), "buckets": buckets, "grads": grads}


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_gradients_travel_in_the_communication_dtype(ranks, wire):
    wire_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[wire]
    low = ranks(2, _train_counting_bytes, {"precision": {"communication_data_type": wire}})
    full = ranks(2, _train_counting_bytes, {})
    ref = _single("fp32")
    assert full[0]["buckets"] == {torch.float32}
    for r, res in enumerate(low):
        assert res["buckets"] == {wire_dtype}, f"rank {r}: buckets {res['buckets']}"
        assert res["grads"] == {torch.float32}, "gradients come back into fp32"
        assert 2 * res["bytes"] == full[r]["bytes"] > 0, "half the bytes on the wire"
        for k, v in res["state"].items():
            assert torch.equal(v, low[0]["state"][k]), f"rank {r} diverged at {k}"
    # Gradients are rounded once to the wire dtype and once more by the sum of two ranks.
    diff = reference.max_rel_diff(low[0]["state"], ref["state"])
    assert diff < TOL[wire], f"{diff:.3g} vs fp32 in one process"
    assert reference.max_rel_diff(full[0]["state"], ref["state"]) < 1e-5


# -- the digits example converges -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_digits_converges_in_low_precision(tmp_path, dtype):
    toml = (ROOT / "examples" / "digits.toml").read_text()
    assert "[precision]" not in toml
    cfg = tmp_path / f"digits_{dtype}.toml"
    cfg.write_text(toml + f'\n[precision]\ndtype = "{dtype}"\n')
    proc = subprocess.run(
        [sys.executable, "-m", "longboat.launch.cli", "run", "-n", "2",
         str(ROOT / "examples" / "digits.py"), "--config", str(cfg)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"precision {dtype}: forward under torch.autocast" in out
    m = re.search(r"accuracy=([0-9.]+)", out)
    assert m, out[-3000:]
    assert float(m.group(1)) >= 0.95
