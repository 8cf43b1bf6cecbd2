"""The report of a search: every candidate with its predicted memory and time, its measured
time and memory where measured, and its status; as a terminal table or as JSON."""

from __future__ import annotations

import datetime
import io
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from longboat.tune.search import Outcome, TuneResult

_MIB = 2**20


def _sorted(result: TuneResult) -> list[Outcome]:
    """Measured (fastest first), then the rest of what fits (cost model's order), then what
    does not fit (smallest excess first), then what is invalid."""

    def key(o: Outcome) -> tuple[int, float]:
        if o.measured is not None:
            return 0, o.measured["step_time_median_s"]
        if o.rank is not None:
            return 1, o.rank
        if o.planned is not None:
            return 2, o.planned.peak
        return 3, 0.0

    return sorted(result.outcomes, key=key)


def _worst(values: list[int] | None) -> int | None:
    return max(values) if values else None


def outcome_json(o: Outcome, winner: str | None) -> dict[str, Any]:
    """One candidate as the JSON report holds it."""
    out: dict[str, Any] = {
        "name": o.name,
        "status": "winner" if o.name == winner else o.status,
        "reason": o.reason,
        "config": o.mapping,
        "rank_by_cost_model": o.rank,
        "predicted": None,
        "measured": o.measured,
    }
    if o.planned is not None:
        out["predicted"] = {**asdict(o.planned), "peak_mib": o.planned.peak / _MIB}
        if o.prediction is not None:
            out["predicted"]["step_time"] = o.prediction.to_json()
    if o.measured is not None and o.prediction is not None and o.planned is not None:
        live = _worst(o.measured["live_peak_bytes_per_rank"])
        rss = _worst(o.measured["rss_increase_bytes_per_rank"])
        out["ratios"] = {
            "measured_over_predicted_step": o.measured["step_time_median_s"] / o.prediction.total_s,
            "measured_live_peak_over_predicted": None if live is None else live / o.planned.peak,
            "rss_increase_over_predicted_peak": None if rss is None else rss / o.planned.peak,
        }
    return out


def to_json(result: TuneResult, outputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole report: settings, model, rates, every candidate, the winner, the files
    written, versions and machine."""
    from longboat.bench.report import machine, versions

    s = result.settings
    bench = result.bench or {}
    counts: dict[str, int] = {}
    for o in result.outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    return {
        "command": "longboat tune",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {**asdict(s), "global_batch": s.batch},
        "model": result.model_info,
        "rates": None if result.rates is None else result.rates.to_json(),
        "counts": counts,
        "winner": result.winner,
        "reason": result.reason,
        "launched": result.launched,
        "phases_s": result.phases_s,
        "notes": result.notes,
        # --top all: [Note: verifying the choice] in verify.py
        "verification": None if result.verification is None else result.verification.to_json(),
        "candidates": [outcome_json(o, result.winner) for o in _sorted(result)],
        "bench": {k: bench[k] for k in ("settings", "round_order", "wall_time_s") if k in bench},
        "outputs": outputs or {},
        "versions": versions(),
        "machine": machine(),
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _first_line(text: str, width: int = 70) -> str:
    line = " ".join(text.split())  # a ConfigError's lines, on one
    return line if len(line) <= width else line[: width - 1] + "…"


def render(result: TuneResult, outputs: dict[str, Any] | None = None, width: int = 160) -> str:
    """The report as text: a row per candidate, then the winner and the files."""
    s = result.settings
    budget = "no budget" if s.budget is None else f"budget {s.budget / _MIB:,.1f} MiB per rank"
    title = (
        f"longboat tune: {s.script or s.model} at {s.world_size} rank(s), global batch "
        f"{s.batch}, {budget}; "
        "peaks in MiB per rank (live tensors, as longboat plan counts them), steps in s"
    )
    table = Table(title=title, title_justify="left")
    for col in (
        "candidate",
        "status",
        "plan peak",
        "pred step",
        "step",
        "step/pred",
        "live peak",
        "RSS +",
        "vs winner",
        "why",
    ):
        table.add_column(col, justify="left" if col in ("candidate", "status", "why") else "right")
    for o in _sorted(result):
        status = "WINNER" if o.name == result.winner else o.status
        m = o.measured or {}
        live = _worst(m.get("live_peak_bytes_per_rank"))
        rss = _worst(m.get("rss_increase_bytes_per_rank"))
        pred = o.prediction.total_s if o.prediction else None
        step = m.get("step_time_median_s")
        table.add_row(
            o.name,
            status,
            _f(o.planned.peak / _MIB if o.planned else None, ",.1f"),
            _f(pred, ".3f"),
            _f(step, ".3f"),
            _f(step / pred if step and pred else None, ".2f"),
            _f(live / _MIB if live else None, ",.1f"),
            _f(rss / _MIB if rss else None, ",.1f"),
            _f(m.get("vs_winner_paired"), ".3f"),
            _first_line(o.reason),
        )
    buf = io.StringIO()
    # The model's name and the reasons are the user's text: no markup, no emoji codes.
    console = Console(
        file=buf, width=width, no_color=True, highlight=False, markup=False, emoji=False
    )
    console.print(table)
    lines = [buf.getvalue().rstrip()]
    r = result.rates
    if r is not None:
        link = "-" if r.link_bytes_per_s is None else f"{r.link_bytes_per_s / 1e9:.2f} GB/s"
        lines.append(
            f"machine: matmul {r.matmul_flops_per_s / 1e9:.1f} GFLOP/s (1 thread), operator "
            f"{r.op_s * 1e6:.1f} us, AdamW {r.adamw_elements_per_s / 1e6:.0f} M elements/s, "
            f"all-reduce {link} and {r.latency_s * 1e6:.0f} us latency"
        )
    lines += [
        "step: median of the measured steps (MAX over ranks); vs winner: median of per-round "
        "ratios; live peak: the planner's count on the real run; RSS +: peak RSS over RSS "
        "before the model (includes allocator retention)",
    ]
    lines += [f"note: {x}" for x in result.notes]
    if result.winner:
        lines.append(f"chosen: {result.winner} ({result.reason})")
    else:
        lines.append(f"chosen: none ({result.reason})")
    v = result.verification
    if v is not None:
        lines.append(f"verified (--top all): {v.verdict}")
        for row in v.rows:
            lines.append(
                f"  {row['candidate']:<28} median {row['step_time_median_s']:.3f} s, paired "
                f"{row['paired_ratio_to_choice']:.3f} x the choice: {row['verdict']}"
            )
        for line in v.left_out:
            lines.append(f"  left out: {_first_line(line, 100)}")
    for what, path in (outputs or {}).items():
        lines.append(f"{what}: {path}")
    return "\n".join(lines)
