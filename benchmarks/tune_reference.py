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
    python benchmarks/tune_reference.py --full     # every candidate that fits; 10-15 minutes

Writes ``benchmarks/results/tune_reference.json`` and the chosen config beside it
(``tune_reference.toml``, ``tune_reference.deepspeed.json`` where DeepSpeed's keys can say it).

``--full`` runs ``longboat tune --top all`` (``tune_reference_full.json``): every candidate
the planner lets through is measured side by side, and the results hold the ratio table for
each (predicted against measured step and memory) and the verdict of
[Note: verifying the choice] (``longboat/tune/verify.py``): whether the choice of the default
``--top 3`` is the fastest of all that fit, within a 5% band of paired per-round ratios. The
space is the default run's, unrestricted: since the planner counts gloo's reduce-scatter staging
([Note: gloo staging] in ``longboat/plan/simulate.py``) it lets 18 of the 56 candidates through
at 400 MiB (14 ZeRO-1, ZeRO-2 at micro-batch 8 with recompute at both bucket sizes, ZeRO-3 at
micro-batches 1 and 8), and each costs about 25 s to measure (6 steps of 1.2-1.6 s side by
side, then a memory launch of its own): about 8 minutes of measuring after 1-3 minutes of
planning. ``--time 30m`` leaves room for a slower machine rather than cutting rounds short; to
shorten it, ``--bucket-mb 25`` halves the ZeRO-1/2 candidates (10 of 28 fit). A smoke run of the
path, in a minute or two::

    python benchmarks/tune_reference.py --full --model tiny-gpt --seq-len 16 --steps 1 \
        --micro-batches 4,8 --bucket-mb 25 --no-recompute --out /tmp/tune_full_smoke.json
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
    p.add_argument("--time", default=None, help="time for the whole search (10m; --full 30m)")
    p.add_argument("--top", default=None, help="candidates measured (3; --full: all)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--full", action="store_true", help="measure every candidate that fits (--top all)"
    )
    p.add_argument("--bucket-mb", default="25,5", help="bucket sizes to try, MiB")
    p.add_argument("--micro-batches", default=None, help="micro-batch sizes (default: all)")
    p.add_argument("--no-recompute", action="store_true", help="do not try recompute")
    p.add_argument("--model", default="reference-gpt", help="for a smoke run: tiny-gpt")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="measured steps per candidate")
    p.add_argument("--out", type=Path, default=None, help="the results JSON")
    args = p.parse_args(argv)
    full = args.full
    args.time = args.time or ("30m" if full else "10m")
    args.top = args.top or ("all" if full else "3")
    args.out = args.out or RESULTS / ("tune_reference_full.json" if full else "tune_reference.json")
    return args


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
                "rank_by_cost_model": c["rank_by_cost_model"],
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
        model=args.model,
        world_size=args.world_size,
        budget=args.budget,
        time=args.time,
        top=args.top,
        seq_len=args.seq_len,
        steps=args.steps,
        bucket_mb=args.bucket_mb,
        micro_batches=args.micro_batches,
        recompute=not args.no_recompute,
    )
    # Relative to where it runs (the repository's root, as documented), so the results name
    # the files as the repository holds them.
    toml = Path(os.path.relpath(args.out.with_suffix(".toml")))
    text, code, report = run(flags, toml, as_json=False)
    print(text, flush=True)
    table = ratio_table(report)
    verification = report["verification"]
    if verification is not None:  # --top all: each row's paired ratio to the default's choice
        paired = {r["candidate"]: r for r in verification["rows"]}
        for r in table:
            v = paired.get(r["candidate"], {})
            r["paired_ratio_to_default_choice"] = v.get("paired_ratio_to_choice")
            r["verdict"] = v.get("verdict", "measured over the budget")
    out = {
        "benchmark": "tune_reference_full" if args.full else "tune_reference",
        "command": (
            f"longboat tune --model {args.model} --world-size {args.world_size} --budget "
            f"{args.budget} --time {args.time} --top {args.top} --bucket-mb {args.bucket_mb} "
            f"--steps {args.steps}"
            + (f" --seq-len {args.seq_len}" if args.seq_len != 128 else "")
            + (f" --micro-batches {args.micro_batches}" if args.micro_batches else "")
            + (" --no-recompute" if args.no_recompute else "")
            + f" --out {toml.name}"
        ),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "exit_status": code,
        "predicted_vs_measured": table,
        # --full: is the default --top 3's choice the fastest of all that fit?
        "verification": verification,
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
    if verification is not None:
        print(f"verdict: {verification['verdict']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
