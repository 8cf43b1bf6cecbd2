"""``longboat tune`` on the reference GPT at 2 ranks, with a memory budget that no ``replicate``
configuration fits: what it drops, what its cost model predicts against what the bench measures,
and what it chooses.

The search is the command's own (``longboat.tune.command.run``), with its defaults but for the
budget: the reference GPT (:func:`longboat.models.reference_gpt`, 21,064,704 parameters,
sequence 128), a global batch of 16, micro-batches 1, 2, 4 and 8, buckets of 25 and 5 MiB,
with and without recomputing the blocks, fp32 communication; the best 3 measured side by side
for 5 steps after 1 warm-up, each then alone for its memory (the planner's live-tensor count on
the real run, and peak RSS under glibc's default malloc). ``--budget 400MiB``: the planner puts
the smallest ``replicate`` peak at 402 MiB (micro-batch 1, no accumulation is not in this space:
the global batch needs 8 micro-batches of 1 per rank, 439 MiB).

Per measured candidate the results give the cost model's prediction against the measured
median step, and the planned peak against the measured live-tensor peak and RSS increase
(``ratios``). Load on the machine is recorded (``os.getloadavg`` before and after), so that a
run beside other CPU-heavy work shows as such.

Usage::

    python benchmarks/tune_reference.py            # from the repository's root; minutes

Writes ``benchmarks/results/tune_reference.json`` and the chosen config beside it
(``tune_reference.toml``, ``tune_reference.deepspeed.json`` where DeepSpeed's keys can say it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from common import machine, versions

from longboat.tune.command import Flags, run

RESULTS = Path(__file__).resolve().parent / "results"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="400MiB", help="memory per rank, as longboat plan counts")
    p.add_argument("--time", default="10m", help="time for the whole search")
    p.add_argument("--top", type=int, default=3, help="candidates measured")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "tune_reference.json")
    return p.parse_args(argv)


def ratio_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per measured candidate: predicted against measured, step time and memory."""
    rows = []
    for c in report["candidates"]:
        m = c["measured"]
        if m is None:
            continue
        pred = c["predicted"]
        live = max(m["live_peak_bytes_per_rank"] or [0]) or None
        grew = max(m["rss_increase_bytes_per_rank"] or [0]) or None
        rows.append(
            {
                "candidate": c["name"],
                "status": c["status"],
                "predicted_step_s": pred["step_time"]["total_s"],
                "measured_step_median_s": m["step_time_median_s"],
                "measured_over_predicted_step": c["ratios"]["measured_over_predicted_step"],
                # the fastest of its steps: the reading least touched by the machine's load
                "measured_step_min_s": min(m["step_times_s"]),
                "fastest_over_predicted_step": min(m["step_times_s"])
                / pred["step_time"]["total_s"],
                "vs_winner_paired": m.get("vs_winner_paired"),
                "planned_peak_mib": pred["peak"] / 2**20,
                "measured_live_peak_mib": None if live is None else live / 2**20,
                "measured_live_over_planned": c["ratios"]["measured_live_peak_over_predicted"],
                "rss_increase_mib": None if grew is None else grew / 2**20,
                "rss_increase_over_planned": c["ratios"]["rss_increase_over_predicted_peak"],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    load_before = os.getloadavg()
    # Before the run writes its config files (tracked): read after, the commit reads as dirty.
    recorded = versions()
    t0 = time.time()
    flags = Flags(
        model="reference-gpt",
        world_size=args.world_size,
        budget=args.budget,
        time=args.time,
        top=args.top,
    )
    # Relative to where it runs (the repository's root, as documented), so the results name
    # the files as the repository holds them.
    toml = Path(os.path.relpath(args.out.with_suffix(".toml")))
    text, code, report = run(flags, toml, as_json=False)
    print(text, flush=True)
    table = ratio_table(report)
    out = {
        "benchmark": "tune_reference",
        "command": (
            f"longboat tune --model reference-gpt --world-size {args.world_size} --budget "
            f"{args.budget} --time {args.time} --top {args.top} --out {toml.name}"
        ),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "exit_status": code,
        "predicted_vs_measured": table,
        "report": report,
        "versions": recorded,
        "machine": {
            **machine(),
            # What else ran shows here: on a quiet machine both stay near 1 or below.
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "wall_time_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"{'candidate':<24} {'pred s':>7} {'median':>7} {'ratio':>6} {'fastest':>7} {'ratio':>6} "
        f"{'plan':>7} {'live':>7}"
    )
    for r in table:
        print(
            f"{r['candidate']:<24} {r['predicted_step_s']:7.3f} {r['measured_step_median_s']:7.3f} "
            f"{r['measured_over_predicted_step']:6.2f} {r['measured_step_min_s']:7.3f} "
            f"{r['fastest_over_predicted_step']:6.2f} {r['planned_peak_mib']:7.1f} "
            f"{r['measured_live_peak_mib'] or 0:7.1f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
