"""The profiler's end-of-run summary: gathered from every rank, printed as a table on rank 0.

Means leave out the first step (warm-up: allocator, lazy initialisation, first collectives)
whenever there is more than one step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from longboat.comm.protocol import Comm
from longboat.observe.breakdown import COLUMNS

_LABELS = {
    "data": "data loading",
    "forward": "forward",
    "backward": "backward",
    "comm": "waiting for communication",
    "optimizer": "optimizer",
    "checkpoint": "checkpointing",
    "monitor": "monitors (events)",
    "other": "other (user code)",
}


@dataclass(frozen=True)
class RunRecord:
    """What one rank measured over the run (the monitor's records)."""

    step_times: list[float]
    phase_totals: dict[str, float]  # every step but the first
    first_phases: dict[str, float]
    breakdown: bool  # phases were timed
    flops: bool  # flops were counted
    flops_per_rank: float = 0.0
    peak_flops: float = 0.0


def gather_summary(comm: Comm, rec: RunRecord) -> dict[str, Any]:
    """Every rank's per-step phase means, median step time and flops, gathered over ``comm``
    (a collective: every rank calls it) into one summary dict."""
    times = rec.step_times[1:] or rec.step_times
    n = max(len(times), 1)
    phases = rec.phase_totals if len(rec.step_times) > 1 else rec.first_phases
    median = statistics.median(times) if times else 0.0
    local = torch.tensor(
        [
            *(phases[c] / n for c in COLUMNS),
            sum(times) / n,
            median,
            rec.flops_per_rank,
            rec.peak_flops,
        ],
        dtype=torch.float64,
    )
    table = torch.empty(comm.world_size * local.numel(), dtype=torch.float64)
    comm.all_gather(table, local)
    table = table.view(comm.world_size, -1)
    k = len(COLUMNS)
    out: dict[str, Any] = {
        "steps": len(times),
        "ranks": comm.world_size,
        "step_ms": float(table[:, k].mean()) * 1e3,
        "step_ms_max": float(table[:, k].max()) * 1e3,
        "median_step_ms": [float(v) * 1e3 for v in table[:, k + 1]],
    }
    if rec.breakdown:
        out["phases_ms"] = {c: float(table[:, i].mean()) * 1e3 for i, c in enumerate(COLUMNS)}
        out["phases_ms_max"] = {c: float(table[:, i].max()) * 1e3 for i, c in enumerate(COLUMNS)}
    if rec.flops:
        per_rank = float(table[0, k + 2])
        achieved = [per_rank / max(float(m), 1e-12) for m in table[:, k + 1]]
        out.update(
            flops_per_rank=per_rank,
            flops_per_step=per_rank * comm.world_size,
            achieved_flops_per_rank=sum(achieved) / len(achieved),
            matmul_flops_per_rank=float(table[:, k + 3].mean()),
            threads=torch.get_num_threads(),
        )
    return out


def render(summary: dict[str, Any], console: Console | None = None) -> None:
    """Print the summary as a table (and a flops line) on ``console`` (default: stderr)."""
    console = console or Console(stderr=True)
    step = summary["step_ms"]
    if "phases_ms" in summary:
        t = Table(
            title=f"longboat step time over {summary['steps']} step(s) x "
            f"{summary['ranks']} rank(s) (first step left out)"
        )
        for col, just in (
            ("phase", "left"),
            ("mean ms/step", "right"),
            ("share", "right"),
            ("max over ranks ms", "right"),
        ):
            t.add_column(col, justify=just)  # type: ignore[arg-type]
        for c in COLUMNS:
            mean = summary["phases_ms"][c]
            t.add_row(
                _LABELS[c],
                f"{mean:.2f}",
                f"{mean / step:.1%}" if step else "-",
                f"{summary['phases_ms_max'][c]:.2f}",
            )
        t.add_row("step", f"{step:.2f}", "100.0%", f"{summary['step_ms_max']:.2f}", style="bold")
        console.print(t)
    if "flops_per_rank" in summary:
        f, a, m = (
            summary["flops_per_rank"],
            summary["achieved_flops_per_rank"],
            summary["matmul_flops_per_rank"],
        )
        share = f" = {a / m:.1%} of it" if m else ""
        console.print(
            f"flops per step: {f / 1e9:.3f} GFLOP per rank x {summary['ranks']} rank(s) = "
            f"{summary['flops_per_step'] / 1e9:.3f} GFLOP; achieved {a / 1e9:.2f} GFLOP/s per "
            f"rank (median step) beside a measured fp32 matmul rate of {m / 1e9:.2f} GFLOP/s "
            f"({summary['threads']} threads){share}"
        )
