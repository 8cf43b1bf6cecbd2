"""The step profiler: wall-clock breakdown accounting, and the flops count."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import reference
import torch
from torch import nn

import longboat
from longboat.observe.breakdown import COLUMNS, Breakdown
from longboat.observe.flops import matmul_rate
from longboat.observe.report import render


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Comm:
    blocked_seconds = 0.0


def test_breakdown_moves_blocked_time_to_comm() -> None:
    clock, comm = _Clock(), _Comm()
    b = Breakdown(comm, clock=clock)
    with b.phase("data"):
        clock.now = 0.5
    clock.now = 1.0  # user code: other
    with b.phase("forward"):
        clock.now = 3.0
    with b.phase("optimizer"):
        clock.now = 4.0
        comm.blocked_seconds += 0.75  # a wait inside the optimizer phase
        clock.now = 5.0
    with b.phase("checkpoint"), b.phase("data"):  # nested: counted once, by the outer phase
        clock.now = 6.0
    got = b.end_step(6.5)
    assert got == {
        "data": 0.5,
        "forward": 2.0,
        "backward": 0.0,
        "comm": 0.75,
        "optimizer": 1.25,
        "checkpoint": 1.0,
        "monitor": 0.0,
        "other": 1.0,
        "step": 6.5,
    }
    clock.now = 7.0
    with b.phase("backward"):
        clock.now = 8.0
    with b.phase("monitor", split_waits=False):  # its waits stay in it
        comm.blocked_seconds += 0.25
        clock.now = 8.5
    assert b.end_step(9.0) == {
        **dict.fromkeys(COLUMNS, 0.0),
        "backward": 1.0,
        "monitor": 0.5,
        "other": 1.0,
        "step": 2.5,
    }  # starts where the first ended


def _profiled(out: str, steps: int = 6) -> dict[str, Any]:
    torch.manual_seed(0)
    model = reference.TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine = longboat.initialize(
        model,
        opt,
        {
            "log": {"progress": False, "level": "WARNING"},
            "batch": {"train_batch_size": 8},
            "strategy": "auto",
            "profile": {"wall_clock_breakdown": True},
            "monitor": {"csv": {"enabled": True, "output_path": out}},
        },
    )
    loader = engine.loader(reference.dataset(8 * steps))
    for x, y in loader:
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        if engine.step() and engine.global_step == 3:
            engine.save_checkpoint(Path(out) / "ckpt")
    engine.close()
    assert engine.monitor.summary is not None
    return engine.monitor.summary


def test_breakdown_two_ranks_adds_up(ranks: Any, tmp_path: Path) -> None:
    summaries = ranks(2, _profiled, str(tmp_path))
    assert summaries[0] == summaries[1]  # gathered: every rank has the same
    s = summaries[0]
    assert s["steps"] == 5 and s["ranks"] == 2
    phases = s["phases_ms"]
    assert all(v >= 0 for k, v in phases.items() if k != "other")
    assert phases["other"] >= -1e-6
    # Real work happened in each phase this loop has; communication was waited for.
    for k in ("data", "forward", "backward", "comm", "optimizer", "checkpoint"):
        assert phases[k] > 0, k
    assert sum(phases.values()) == pytest.approx(s["step_ms"], rel=1e-9)
    assert all(s["phases_ms_max"][k] >= phases[k] * (1 - 1e-12) for k in COLUMNS)
    with (tmp_path / "longboat" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    for r in rows:  # per-step phases are rank means; the step is the slowest rank's
        parts = [float(r[f"{k}_ms"]) for k in COLUMNS]
        assert min(parts[:-1]) >= 0
        assert sum(parts) <= float(r["step_ms"]) * (1 + 1e-9)
    assert float(rows[3]["checkpoint_ms"]) > 0  # saved after step 3: counted in step 4
    assert all(float(rows[i]["checkpoint_ms"]) == 0 for i in (0, 1, 2, 4, 5))
    # Each event is reduced and written at the end of its step: counted in the next one.
    assert float(rows[0]["monitor_ms"]) == 0 and all(float(r["monitor_ms"]) > 0 for r in rows[1:])


B, D_IN, D_HID, D_OUT = 5, 8, 16, 4


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D_IN, D_HID)
        self.b = nn.Linear(D_HID, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _analytic_flops_per_micro_batch() -> int:
    fwd = 2 * B * D_IN * D_HID + 2 * B * D_HID * D_OUT
    # Backward: grad of weight and of input for b; for a only the weight (x needs no grad).
    bwd = 2 * (2 * B * D_HID * D_OUT) + 2 * B * D_IN * D_HID
    return fwd + bwd


def _count_flops(accumulation: int, strategy: dict[str, Any] | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Mlp()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            "log": {"progress": False, "level": "WARNING"},
            "batch": {"micro_batch_size": B, "gradient_accumulation_steps": accumulation},
            "profile": {"flops": True},
            **(strategy or {}),
        },
    )
    x = torch.randn(B * 40, D_IN)
    y = torch.randint(0, D_OUT, (B * 40,))
    for xb, yb in engine.loader(torch.utils.data.TensorDataset(x, y)):
        engine.backward(nn.functional.cross_entropy(engine(xb), yb))
        engine.step()
    engine.close()
    assert engine.monitor.summary is not None
    return engine.monitor.summary


def test_flops_equal_the_analytic_count() -> None:
    s = _count_flops(accumulation=2)
    assert s["flops_per_rank"] == 2 * _analytic_flops_per_micro_batch()
    assert s["flops_per_step"] == s["flops_per_rank"]
    assert s["achieved_flops_per_rank"] > 0 and s["matmul_flops_per_rank"] > 0
    assert "phases_ms" not in s


@pytest.mark.parametrize("strategy", [{}, {"strategy": "zero", "zero": {"stage": 3}}])
def test_flops_two_ranks(ranks: Any, strategy: dict[str, Any]) -> None:
    s = ranks(2, _count_flops, 1, strategy)[0]
    assert s["flops_per_rank"] == _analytic_flops_per_micro_batch()
    assert s["flops_per_step"] == 2 * _analytic_flops_per_micro_batch()


def test_matmul_rate_counts_its_products() -> None:
    # A tiny size measured for at least 10 ms: the rate is finite and positive.
    assert 0 < matmul_rate(torch.device("cpu"), seconds=0.01, n=64) < float("inf")


def test_render_table() -> None:
    from rich.console import Console

    console = Console(record=True, width=120)
    render(
        {
            "steps": 4,
            "ranks": 2,
            "step_ms": 10.0,
            "step_ms_max": 11.0,
            "phases_ms": {**dict.fromkeys(COLUMNS, 1.0), "forward": 4.0},
            "phases_ms_max": dict.fromkeys(COLUMNS, 2.0),
            "flops_per_rank": 2e9,
            "flops_per_step": 4e9,
            "achieved_flops_per_rank": 2e11,
            "matmul_flops_per_rank": 4e11,
            "threads": 2,
        },
        console,
    )
    text = console.export_text()
    assert "forward" in text and "40.0%" in text and "50.0% of it" in text
