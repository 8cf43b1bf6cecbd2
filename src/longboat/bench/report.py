"""The outputs of ``longboat bench``: a terminal table, a JSON file, a Markdown report and a PNG
chart (samples/s against world size, one line per side)."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

# What a side does at one rank, where "distributed" means little (for the report's readers).
AT_ONE_RANK = {
    "single": "plain training, the baseline (exists at world size 1 only)",
    "replicate": "longboat replicate on a group of one: its hooks and bucket copies run, the "
    "all-reduce has no peer",
    "zero": "longboat ZeRO on a group of one: the shard is the whole model; the collectives "
    "have no peer",
    "ddp": "torch DDP on a group of one: reducer hooks and bucket copies, no peer",
    "fsdp2": "FSDP2 over a mesh of one: DTensor parameters, all-gather/reduce-scatter of one",
    "deepspeed": "DeepSpeed's engine at that ZeRO stage on one rank",
}

MIN_STEPS = 10  # fewer measured steps than this is a check that it runs, not a measurement
SMOKE = (
    "Smoke run: {steps} measured step(s) per side, fewer than the 10 a comparison needs; "
    "these timings show that every side runs, not how fast."
)

COLUMNS = (
    "side",
    "ranks",
    "batch",
    "median s",
    "IQR s",
    "min-max s",
    "samples/s",
    "speed-up",
    "efficiency",
    "peak RSS MiB",
    "state MiB",
)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_commit(where: str | os.PathLike[str]) -> str | None:
    """The git commit of the checkout holding ``where``, with ``+dirty`` when its tracked files
    had changes (a result measured on uncommitted code cannot be traced back to one); None
    outside a checkout (an installed wheel)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def versions() -> dict[str, str | None]:
    """Python, torch, longboat (and its commit, from a checkout) and the peers' versions, and
    the platform."""
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    out.update({name: _version(name) for name in ("longboat", "deepspeed", "matplotlib")})
    out["commit"] = source_commit(Path(__file__).resolve().parent)
    out["platform"] = platform.platform()
    return out


def machine() -> dict[str, object]:
    """The machine measured on (no hostname): results from two machines are comparable only
    where these agree. The CPU's model and the widest vector instructions torch's kernels use
    tell apart machines that have the same core count: ``benchmarks/pipeline.py``'s replicate
    step took 1.5-1.9 s on one 2-core machine and 4.0-5.9 s on another."""
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "processor": platform.processor(),
        "machine": platform.machine(),
    }


def _cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else the platform's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor()


def finish(raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: the runner's results plus date, versions, machine and notes."""
    s = raw["settings"]
    scaling = (
        "weak: the micro-batch per rank stays the same, the global batch grows with the ranks"
        if s["scaling"] == "weak"
        else "strong: the global batch stays the same, split over the ranks"
    )
    return {
        "benchmark": "longboat bench",
        "max_abs_loss_diff": loss_agreement(raw["rows"]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **raw,
        "notes": {
            "scaling": scaling,
            "step_time": "forward, loss, backward, optimizer step, zero_grad; perf_counter per "
            "rank, MAX over ranks; median over the measured steps",
            "samples_per_s": "global batch / median step time",
            "speedup": "samples/s at n ranks / samples/s of the same side at 1 rank",
            "efficiency": "speed-up / n",
            "peak_rss": "ru_maxrss of each rank of a fresh launch running that side alone "
            "(the table shows the largest rank); it includes torch itself",
            "state_bytes": "parameters + gradients + optimizer state on each rank, counted from "
            "tensor storages (None / '-': not exposed by the library); the table "
            "shows the largest rank",
            "at_one_rank": AT_ONE_RANK,
            "pipeline": f"mesh.pp = world size (one stage per rank), 1F1B, the global batch in "
            f"{s['pipeline_micro_batches']} micro-batches per step; no row at one rank, so no "
            "speed-up: compare its samples/s with replicate's at the same world size",
            "tensor-parallel": "mesh.tp = world size, the model's built-in plan, every rank "
            "the whole global batch in one forward; no row at one rank: compare its samples/s "
            "with replicate's at the same world size",
        },
        "versions": versions(),
        "machine": machine(),
    }


def loss_agreement(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per world size, the largest per-step loss difference between any side and the first:
    all sides do the same arithmetic on the same samples, so this should be float noise."""
    out: dict[str, float] = {}
    for n in sorted({r["world_size"] for r in rows}):
        here = [r["losses"] for r in rows if r["world_size"] == n]
        out[str(n)] = max(
            abs(a - b) for losses in here for a, b in zip(losses, here[0], strict=True)
        )
    return out


def _mib(values: list[int | None] | None) -> str:
    if not values or any(v is None for v in values):
        return "-"
    return f"{max(v for v in values if v is not None) / 2**20:,.1f}"


def _rate(v: float) -> str:
    return f"{v:,.2f}" if v < 100 else f"{v:,.1f}"  # a big model does a few samples/s


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def rows_as_text(result: dict[str, Any]) -> list[list[str]]:
    """The table's cells, one list per side and world size."""
    return [
        [
            r["side"],
            str(r["world_size"]),
            str(r["global_batch"]),
            f"{r['step_time_median_s']:.4f}",
            f"{r['step_time_iqr_s']:.4f}",
            f"{r['step_time_min_s']:.4f}-{r['step_time_max_s']:.4f}",
            _rate(r["samples_per_s"]),
            _opt(r["speedup"], ".2f"),
            _opt(r["efficiency"], ".2f"),
            _mib(r["peak_rss_bytes_per_rank"]),
            _mib(r["state_bytes_per_rank"]),
        ]
        for r in result["rows"]
    ]


def print_table(result: dict[str, Any], console: Console | None = None) -> None:
    """The table on the terminal, then the sides that did not run and why."""
    # The table is wide: keep it whole in a pipe or a narrow terminal rather than truncated.
    console = console or Console(width=max(Console().width, 140))
    s = result["settings"]
    table = Table(
        title=f"longboat bench: {s['model']}, {s['scaling']} scaling, "
        f"{s['steps']} measured steps after {s['warmup']} warm-up"
    )
    for c in COLUMNS:
        table.add_column(c, justify="left" if c == "side" else "right", no_wrap=True)
    for cells in rows_as_text(result):
        table.add_row(*cells)
    console.print(table)
    for side, why in result["unavailable"].items():
        console.print(f"[yellow]{side} not run:[/] {why}")
    if s["steps"] < MIN_STEPS:
        console.print(f"[yellow]{SMOKE.format(steps=s['steps'])}[/]")
    for n, v in result["max_abs_loss_diff"].items():
        console.print(f"largest loss difference between sides at {n} rank(s): {v:.2g}")


def markdown(result: dict[str, Any], chart: str | None) -> str:
    """The Markdown report: table, chart, notes, the full settings, versions and machine."""
    s = result["settings"]
    lines = [
        f"# longboat bench: {s['model']}",
        "",
        f"{result['date']}, world sizes {', '.join(map(str, s['world_sizes']))}, "
        f"{s['threads']} thread(s) per rank, {s['scaling']} scaling, {s['steps']} measured "
        f"step(s) per side after {s['warmup']} warm-up. Wall time "
        f"{result['wall_time_s']:.0f} s.",
        "",
        "Model: "
        + ", ".join(
            f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}"
            for k, v in result.get("model", {}).items()
        ),
        "",
    ]
    if s["steps"] < MIN_STEPS:
        lines += [f"**{SMOKE.format(steps=s['steps'])}**", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows_as_text(result)]
    lines.append("")
    if result["unavailable"]:
        lines += ["Not run:", ""]
        lines += [f"- `{side}`: {why}" for side, why in result["unavailable"].items()]
        lines.append("")
    diffs = ", ".join(f"{v:.2g} at {n} rank(s)" for n, v in result["max_abs_loss_diff"].items())
    lines += [
        f"Largest per-step loss difference between sides: {diffs} (same samples, same "
        "initial weights: every side computes the same training run).",
        "",
    ]
    if chart:
        lines += [f"![samples/s against world size]({chart})", ""]
    notes = result["notes"]
    lines += ["## What the columns mean", ""]
    lines += [f"- {key}: {text}" for key, text in notes.items() if key != "at_one_rank"]
    lines += ["", "At world size 1:", ""]
    lines += [f"- `{k}`: {v}" for k, v in notes["at_one_rank"].items()]
    lines += [
        "",
        "## Settings",
        "",
        "```json",
        json.dumps(s, indent=2),
        "```",
        "",
        "## Versions and machine",
        "",
        "```json",
        json.dumps({"versions": result["versions"], "machine": result["machine"]}, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)


def chart(result: dict[str, Any], path: Path) -> None:
    """Samples/s against world size, one line per side (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    s = result["settings"]
    fig, ax = plt.subplots(figsize=(9, 5), dpi=100)
    sides = list(dict.fromkeys(r["side"] for r in result["rows"]))
    # 20 distinct colours, and one line style per library, so no two sides look alike.
    tab20 = plt.get_cmap("tab20")
    assert isinstance(tab20, ListedColormap)  # a qualitative map: its colours are a list
    colours = tab20.colors
    assert isinstance(colours, (list, tuple))
    styles = {"longboat": "-", "ddp": "--", "fsdp2": ":", "deepspeed": "-."}
    for i, side in enumerate(sides):
        rows = [r for r in result["rows"] if r["side"] == side]
        pts = sorted((r["world_size"], r["samples_per_s"]) for r in rows)
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=side,
            color=colours[i % len(colours)],
            linestyle=styles.get(rows[0]["library"], "-"),
        )
    ax.set_xticks(list(s["world_sizes"]))
    ax.set_xlabel("world size (ranks, one thread each)")
    ax.set_ylabel("samples/s (global batch / median step)")
    smoke = (
        f" (smoke run: {s['steps']} step(s), not a measurement)"
        if s["steps"] < MIN_STEPS
        else f", median of {s['steps']} steps"
    )
    ax.set_title(f"{s['model']}: {s['scaling']} scaling, micro-batch {s['micro_batch']}{smoke}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_all(result: dict[str, Any], out: Path) -> dict[str, Path]:
    """Write ``bench.json``, ``bench.png`` and ``bench.md`` under ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "png": out / "bench.png", "md": out / "bench.md"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    chart(result, paths["png"])
    paths["md"].write_text(markdown(result, paths["png"].name))
    return paths
