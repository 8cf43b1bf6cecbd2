"""Why peak RSS sits far above the live tensors on CPU: glibc's heap keeps what tensors free.

``longboat plan`` predicts the live-tensor peak of a ZeRO-2 rank of the reference GPT within a
few hundred bytes (tested), yet the rank's peak RSS rises about 1.5 times that much above its
RSS after the model was built. The rest is the C allocator: glibc serves requests above its
mmap threshold with ``mmap`` (returned to the system on free), but raises that threshold to the
size of each mmapped block freed (up to 32 MiB), so after the first step nearly every tensor
comes from the heap, whose freed blocks stay resident. Setting the threshold (or any other
``M_*`` parameter but the arena count) fixes it and ends the adjustment: memory goes back to the
system on every free, and each large tensor's pages are faulted in anew. Besides, every thread
that allocates gets an arena of its own, which keeps what that thread freed: gloo's worker
threads each keep a bucket-sized scratch ([Note: one arena] in ``longboat/heap.py``).

This runs ``zero_vs_peers.py --only SIDE`` in fresh process pairs for each side, with glibc's
defaults, with ``MALLOC_MMAP_THRESHOLD_=1048576`` (1 MiB) and with ``MALLOC_ARENA_MAX=1``,
alternating (ABBA over repeats), and records each run's peak RSS, its increase over the built
model, and its step times (the timing pair and the memory pair). All are settings a user can
choose (glibc's environment variables); longboat itself sets one arena when it creates a gloo
group, which in ``zero_vs_peers.py`` it does not (the script creates the group for every side).

Usage::

    python benchmarks/malloc_retention.py                 # 2 repeats, ~12 minutes
    python benchmarks/malloc_retention.py --sides longboat_zero2 --repeats 1

Writes ``benchmarks/results/malloc_retention.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, versions

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "malloc_retention.json"
SETTINGS = {
    "glibc default": {},
    "mmap threshold 1 MiB": {"MALLOC_MMAP_THRESHOLD_": "1048576"},
    # What longboat sets itself when it creates a gloo group ([Note: one arena] in heap.py);
    # zero_vs_peers.py creates the group before either library, so neither side gets it there.
    "one arena": {"MALLOC_ARENA_MAX": "1"},
}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sides", default="longboat_zero2,deepspeed_zero2")
    p.add_argument("--steps", type=int, default=10, help="measured steps per pair")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    return args


def _run(side: str, env: dict[str, str], steps: int, out: Path) -> dict[str, float] | str:
    cmd = [
        sys.executable,
        str(HERE / "zero_vs_peers.py"),
        "--only",
        side,
        "--rounds",
        str(steps),
        "--memory-repeats",
        "1",
        "--memory-steps",
        str(steps),
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **env}
    )
    if proc.returncode != 0 or not out.exists():
        return f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}"
    data = json.loads(out.read_text())
    if side not in data.get("peak_rss_bytes", {}):
        return f"not run: {data.get('unavailable', {}).get(side, 'no result')}"
    return {
        "peak_rss_bytes": data["peak_rss_bytes"][side],
        "rss_increase_bytes": data["rss_increase_bytes"][side],
        "step_median_s": data["medians_s"][side],
        "isolated_step_median_s": data["isolated_medians_s"][side],
    }


def _live_peak_zero2() -> int:
    """``longboat plan``'s live-tensor peak of a ZeRO-2 rank (the settings above)."""
    from longboat.config import load_config
    from longboat.plan import make_plan, resolve

    plan = make_plan(
        resolve("reference-gpt"),
        load_config({"strategy": "zero", "zero": {"stage": 2}}),
        2,
        8,
        "adamw",
        ["zero-2"],
    )
    return plan.strategies[0].peak


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        s: {k: [] for k in SETTINGS} for s in args.sides
    }
    failed: dict[str, str] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            names = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
            for side in args.sides:
                for name in names:
                    got = _run(side, SETTINGS[name], args.steps, Path(tmp, f"{side}-{r}.json"))
                    if isinstance(got, str):
                        failed[f"{side} / {name}"] = got
                        print(f"{side} / {name}: {got}", flush=True)
                        continue
                    runs[side][name].append(got)
                    print(
                        f"repeat {r}: {side:<16} {name:<22} peak RSS "
                        f"{got['peak_rss_bytes'] / 2**20:,.0f} MiB (+"
                        f"{got['rss_increase_bytes'] / 2**20:,.0f}), step "
                        f"{got['step_median_s']:.3f} s ({time.perf_counter() - t0:.0f} s)",
                        flush=True,
                    )
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for side, by in runs.items():
        summary[side] = {}
        for name, xs in by.items():
            if xs:
                summary[side][name] = {k: statistics.median(x[k] for x in xs) for k in xs[0]}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for side, by in summary.items():
        b = by.get("glibc default")
        for name, a in by.items():
            if b and name != "glibc default":
                ratios.setdefault(side, {})[name] = {
                    "rss_increase": a["rss_increase_bytes"] / b["rss_increase_bytes"],
                    "peak_rss": a["peak_rss_bytes"] / b["peak_rss_bytes"],
                    "step_time": a["step_median_s"] / b["step_median_s"],
                    "isolated_step_time": a["isolated_step_median_s"] / b["isolated_step_median_s"],
                }
    result = {
        "benchmark": "malloc_retention",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "sides": args.sides,
            "settings": SETTINGS,
            "measured_steps_per_pair": args.steps,
            "repeats": args.repeats,
            "order": "settings ABBA over repeats",
            "how": "zero_vs_peers.py --only SIDE --memory-repeats 1 per run",
            "model": "reference GPT (21,064,704 parameters), micro-batch 8 x 128, AdamW, "
            "2 ranks x 1 thread",
        },
        "plan_live_peak_bytes_longboat_zero2": _live_peak_zero2(),
        "summary": summary,
        "ratios_over_default": ratios,
        "runs": runs,
        "failed": failed,
        "wall_time_s": time.perf_counter() - t0,
        "versions": versions(),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    live = result["plan_live_peak_bytes_longboat_zero2"]
    print(f"longboat_zero2 live-tensor peak (plan): {live / 2**20:,.0f} MiB")
    for side, by_setting in ratios.items():
        for name, rs in by_setting.items():
            print(
                f"{side}: {name} / default: RSS increase {rs['rss_increase']:.3f}, "
                f"peak RSS {rs['peak_rss']:.3f}, step time {rs['step_time']:.3f}"
            )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
