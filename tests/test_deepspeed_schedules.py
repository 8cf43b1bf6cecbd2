"""DeepSpeed's ``WarmupLR`` and ``WarmupDecayLR`` give, optimizer step for optimizer step, the
learning rates DeepSpeed 0.19.8 gives.

The expected values are DeepSpeed's formula, written out below from its source. Every case here
was also compared with the real DeepSpeed 0.19.8 package (its ``deepspeed/runtime/lr_schedules.py``
loaded on its own, stepped as ``DeepSpeedEngine._take_model_step`` steps it) over 14 steps: the
same numbers to 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch

from longboat.config.sections import SchedulerConfig
from longboat.optim import build_scheduler


def deepspeed_lr(
    optimizer_step: int,
    warmup_min_lr: float,
    warmup_max_lr: float,
    warmup_num_steps: int,
    warmup_type: str = "log",
    total_num_steps: int | None = None,
) -> float:
    """The lr DeepSpeed 0.19.8 uses for optimizer step ``optimizer_step`` (from 1).

    deepspeed/runtime/lr_schedules.py: ``WarmupLR.__init__`` starts at last_batch_iteration -1
    and sets the optimizer to the min lrs; ``WarmupLR.step`` adds 1, then
    ``get_lr`` = min_lr + (max_lr - min_lr) * ``_get_gamma()``, with ``warmup_num_steps`` raised
    to at least 2. ``WarmupLR._get_gamma``: log(it + 1) / log(warmup_num_steps) ("log") or
    it / warmup_num_steps ("linear") while it < warmup_num_steps, else 1.
    ``WarmupDecayLR._get_gamma`` after warmup: max(0, (total - it) / max(1, total - warmup)).
    deepspeed/runtime/engine.py: initialize does not step the scheduler;
    ``DeepSpeedEngine._take_model_step`` calls ``lr_scheduler.step()`` after
    ``optimizer.step()``. So optimizer step k runs at iteration k - 2.
    """
    n = max(2, warmup_num_steps)
    it = optimizer_step - 2
    if it < 0:
        return warmup_min_lr
    if it < n:
        gamma = math.log(it + 1) / math.log(n) if warmup_type == "log" else it / n
    elif total_num_steps is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total_num_steps - it) / max(1.0, total_num_steps - n))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def longboat_lrs(typ: str, params: dict[str, object], steps: int) -> list[float]:
    """The lr of each optimizer step, the scheduler stepped after it (engine/core.py)."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = build_scheduler(opt, SchedulerConfig(type=typ, params=dict(params)))
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup_num_steps", [1, 2, 5])
def test_warmup_lr_matches_deepspeed_step_for_step(warmup_type, warmup_num_steps):
    params = {
        "warmup_min_lr": 0.001,
        "warmup_max_lr": 0.01,
        "warmup_num_steps": warmup_num_steps,
        "warmup_type": warmup_type,
    }
    steps = warmup_num_steps + 5  # through the warmup boundary and past it
    got = longboat_lrs("WarmupLR", params, steps)
    want = [
        deepspeed_lr(k, 0.001, 0.01, warmup_num_steps, warmup_type) for k in range(1, steps + 1)
    ]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the first two optimizer steps both run at warmup_min_lr, as in DeepSpeed
    assert got[:2] == pytest.approx([0.001, 0.001])


def test_warmup_lr_reaches_max_exactly_at_the_boundary():
    got = longboat_lrs(
        "WarmupLR",
        {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.01,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
        8,
    )
    # iteration 3 (step 5) is the last below warmup_num_steps: 3/4 of the way; iteration 4
    # (step 6) is the first at max
    assert got[4] == pytest.approx(0.0075)
    assert got[5:] == pytest.approx([0.01] * 3)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr_matches_deepspeed_step_for_step(warmup_type):
    params = {
        "total_num_steps": 10,
        "warmup_min_lr": 0.001,
        "warmup_max_lr": 0.01,
        "warmup_num_steps": 4,
        "warmup_type": warmup_type,
    }
    got = longboat_lrs("WarmupDecayLR", params, 14)
    want = [deepspeed_lr(k, 0.001, 0.01, 4, warmup_type, total_num_steps=10) for k in range(1, 15)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    # decays linearly down to warmup_min_lr (not 0) at total_num_steps, and stays there
    assert got[5] == pytest.approx(0.01)
    assert got[11:] == pytest.approx([0.001] * 3)


def test_an_unknown_warmup_type_warms_up_logarithmically_as_deepspeed_does(caplog):
    """DeepSpeed's WarmupLR warns and falls back to 'log' for any other warmup_type."""
    params = {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 5}
    got = longboat_lrs("WarmupLR", {**params, "warmup_type": "cosine"}, 8)
    want = [deepspeed_lr(k, 0.001, 0.01, 5, "log") for k in range(1, 9)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert "warmup_type = 'cosine'" in caplog.text
