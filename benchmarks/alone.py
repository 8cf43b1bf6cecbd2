"""Each side alone in fresh process pairs: the reading beside the interleaved one.

``replicate_vs_ddp.py`` and ``zero_vs_peers.py`` time their sides interleaved in one process
pair (single steps alternated, so the machine's load lands on every side alike). A user runs one
side in fresh processes, where allocator warm-up, page faults and the machine's load of the
moment fall on that side only. This script runs every side of both benchmarks that way: each
side in its own fresh pair of ranks (``--only SIDE``), ``--steps`` measured steps after 2
warm-up, the sides' order reversed every other repeat (ABBA), ``--repeats`` times; same model
(the reference GPT), batch and settings as the two benchmarks.

Reported: per side the median step over all its measured steps; per pair of sides the ratio of
those medians, the median of the per-repeat ratios (each repeat's pairs ran minutes apart at
most, so that one cancels slow drifts of the machine), and the ratio of each side's fastest
step (what each side does when the machine is quiet: on a shared machine another tenant's load
can slow a whole fresh pair by half, which interleaving cancels and running alone does not).

Usage::

    python benchmarks/alone.py                   # 2 repeats x 8 sides x 10 steps, ~15 minutes
    python benchmarks/alone.py --steps 5 --repeats 1 --sides replicate,ddp   # a smoke run
    python benchmarks/alone.py --summarize benchmarks/results/alone.json     # readings again

Writes ``benchmarks/results/alone.json`` (``--out`` to change) with config, versions and machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, versions

HERE = Path(__file__).resolve().parent
SCRIPT_OF = {
    "replicate": "replicate_vs_ddp.py",
    "ddp": "replicate_vs_ddp.py",
    **{
        s: "zero_vs_peers.py"
        for s in (
            "longboat_zero2",
            "fsdp2_zero2",
            "deepspeed_zero2",
            "longboat_zero3",
            "fsdp2_zero3",
            "deepspeed_zero3",
        )
    },
}
PAIRS = [
    ("replicate", "ddp"),
    ("longboat_zero2", "fsdp2_zero2"),
    ("longboat_zero2", "deepspeed_zero2"),
    ("longboat_zero3", "fsdp2_zero3"),
    ("longboat_zero3", "deepspeed_zero3"),
    ("longboat_zero3", "replicate"),
]
DEFAULT_OUT = HERE / "results" / "alone.json"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default=",".join(SCRIPT_OF), help="comma-separated sides")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--repeats", type=int, default=2, help="fresh pairs per side")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument(
        "--summarize", type=Path, help="recompute the readings of a results file, run nothing"
    )
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = [s for s in args.sides if s not in SCRIPT_OF]
    if unknown:
        p.error(f"--sides: unknown {unknown}; choose from {list(SCRIPT_OF)}")
    return args


def _run_alone(side: str, steps: int, tmp: Path, index: int) -> list[float] | str:
    """One fresh pair of ranks training ``side`` alone; its measured step times, or why not."""
    out = tmp / f"{side}-{index}.json"
    cmd = [
        sys.executable,
        str(HERE / SCRIPT_OF[side]),
        "--only",
        side,
        "--rounds",
        str(steps),
        "--out",
        str(out),
    ]
    if SCRIPT_OF[side] == "zero_vs_peers.py":
        cmd += ["--memory-repeats", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not out.exists():
        return f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}"
    data = json.loads(out.read_text())
    if side not in data.get("samples_s", {}):
        return f"not run: {data.get('unavailable', {}).get(side, 'no samples')}"
    return [float(x) for x in data["samples_s"][side]]


def _summary(
    samples: dict[str, list[list[float]]],
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Per side the median step; per pair three readings: the ratio of the medians, the median
    of the per-repeat ratios, and the ratio of the fastest steps (the machine's quiet moments:
    on a shared machine the load of the moment can slow a whole run by half, see the README)."""
    ran = [s for s in samples if samples[s]]
    medians = {s: statistics.median(x for run in samples[s] for x in run) for s in ran}
    ratios: dict[str, dict[str, float]] = {}
    for a, b in PAIRS:
        if a in medians and b in medians:
            per_repeat = [
                statistics.median(ra) / statistics.median(rb)
                for ra, rb in zip(samples[a], samples[b], strict=False)
            ]
            ratios[f"{a}/{b}"] = {
                "ratio_of_medians": medians[a] / medians[b],
                "median_of_repeat_ratios": statistics.median(per_repeat),
                "ratio_of_minima": min(map(min, samples[a])) / min(map(min, samples[b])),
            }
    return medians, ratios


def _print_ratios(ratios: dict[str, dict[str, float]]) -> None:
    for k, v in ratios.items():
        print(
            f"ratio {k:<34} {v['ratio_of_medians']:.3f} "
            f"(median of per-repeat ratios {v['median_of_repeat_ratios']:.3f}, "
            f"of minima {v['ratio_of_minima']:.3f})"
        )


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.summarize is not None:  # the readings again from a results file's samples
        data = json.loads(args.summarize.read_text())
        data["medians_s"], data["ratios"] = _summary(data["samples_s"])
        args.summarize.write_text(json.dumps(data, indent=2) + "\n")
        _print_ratios(data["ratios"])
        return
    samples: dict[str, list[list[float]]] = {s: [] for s in args.sides}
    failed: dict[str, str] = {}
    order_log: list[list[str]] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = args.sides if r % 2 == 0 else list(reversed(args.sides))
            order_log.append(order)
            for side in order:
                if side in failed:
                    continue
                got = _run_alone(side, args.steps, Path(tmp), r)
                if isinstance(got, str):
                    failed[side] = got
                    print(f"{side}: {got}", flush=True)
                    continue
                samples[side].append(got)
                print(
                    f"repeat {r}: {side:<16} median {statistics.median(got):.4f} s "
                    f"({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    ran = [s for s in args.sides if samples[s]]
    medians, ratios = _summary(samples)
    result = {
        "benchmark": "alone",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "sides": args.sides,
            "measured_steps_per_run": args.steps,
            "warmup_steps_per_run": 2,
            "repeats": args.repeats,
            "order": "ABBA over repeats",
            "scripts": {s: SCRIPT_OF[s] for s in args.sides},
            "model": "reference GPT (21,064,704 parameters), micro-batch 8 x 128, AdamW, "
            "2 ranks x 1 thread, the benchmarks' default settings",
        },
        "medians_s": medians,
        "ratios": ratios,
        "samples_s": samples,
        "failed": failed,
        "order": order_log,
        "wall_time_s": time.perf_counter() - t0,
        "versions": versions(),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for s in ran:
        print(f"{s:<16} median {medians[s]:.4f} s over {sum(map(len, samples[s]))} steps")
    _print_ratios(ratios)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
