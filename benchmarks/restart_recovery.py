"""Fault tests 1 and 2 of RELIABILITY.md as a benchmark: SIGKILL one rank mid-run, N times.

Each repetition runs ``longboat run -n 2 --max-restarts 1`` on ``tests/launch_scripts/
train_resume.py`` (TinyNet, ZeRO-2, a checkpoint every 2 steps, 9 steps): on the first attempt
rank 1 SIGKILLs itself right after step 5; the launcher must name it, restart both workers, and
they must resume from the step-4 checkpoint and finish with weights bit-identical to an
uninterrupted run (run once first). Per repetition it records:

- ``detect_s``: from the kill (the worker's timestamp just before ``os.kill``) to the
  launcher's line naming the killed rank (timestamped on arrival here);
- ``restart_s``: from the kill to the restarted workers having loaded the checkpoint (their
  ``START attempt=1`` timestamp);
- ``training_again_s``: from the kill to the first step completed after the restart;
- ``steps_redone``: steps trained twice (the kill step minus the resumed step).

Usage::

    python benchmarks/restart_recovery.py --repeats 20

Writes ``benchmarks/results/restart_recovery.json`` (``--out`` to change) and prints a summary
with the success rate and p50/p95 of each figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from common import machine, versions
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "launch_scripts" / "train_resume.py"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "restart_recovery.json"
STEPS, KILL_AT = 9, 5
TIMEOUT_S = 180


def _launch(ck: Path, out: Path, kill: bool) -> tuple[int, list[tuple[float, str]]]:
    """Run one job; its return code and every output line with its arrival time."""
    args = [
        sys.executable,
        "-m",
        "longboat.cli",
        "run",
        "-n",
        "2",
        "--max-restarts",
        "1",
        str(SCRIPT),
        str(ck),
        str(out),
        str(STEPS),
    ]
    if kill:
        args += ["--kill-at", str(KILL_AT)]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: list[tuple[float, str]] = []
    lock = threading.Lock()

    def pump(stream: Any) -> None:
        for line in stream:
            with lock:
                lines.append((time.time(), line.rstrip("\n")))

    pumps = [
        threading.Thread(target=pump, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)
    ]
    for t in pumps:
        t.start()
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = -1
    for t in pumps:
        t.join(timeout=5)
    return code, sorted(lines)


def _stamp(lines: list[tuple[float, str]], pattern: str) -> float | None:
    for _, line in lines:
        m = re.search(pattern, line)
        if m:
            return float(m.group(1))
    return None


def _one(work: Path, i: int, reference: Path) -> dict[str, Any]:
    ck, out = work / f"ck{i}", work / f"w{i}.safetensors"
    code, lines = _launch(ck, out, kill=True)
    kill = _stamp(lines, r"KILL step=\d+ t=([\d.]+)")
    detect = next((t for t, line in lines if "rank 1 was killed by SIGKILL" in line), None)
    start = _stamp(lines, r"START attempt=1 step=\d+ t=([\d.]+)")
    resumed = re.search(r"START attempt=1 step=(\d+)", "\n".join(x for _, x in lines))
    after = [
        float(m.group(1))
        for _, x in lines
        if (m := re.search(r"STEP \d+ t=([\d.]+)", x)) and start and float(m.group(1)) > start
    ]
    equal = False
    if code == 0 and out.exists():
        a, b = load_file(out), load_file(reference)
        equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {
        "exit_code": code,
        "bit_identical": equal,
        "recovered": code == 0 and equal,
        "detect_s": None if kill is None or detect is None else detect - kill,
        "restart_s": None if kill is None or start is None else start - kill,
        "training_again_s": None if kill is None or not after else min(after) - kill,
        "steps_redone": None if resumed is None else KILL_AT - int(resumed.group(1)),
        "tail": [x for _, x in lines[-8:]] if code != 0 else [],
    }


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="longboat-restart-") as tmp:
        work = Path(tmp)
        code, lines = _launch(work / "ref-ck", work / "ref.safetensors", kill=False)
        if code != 0:
            sys.exit(
                "the uninterrupted reference run failed:\n" + "\n".join(x for _, x in lines[-20:])
            )
        runs = []
        for i in range(args.repeats):
            r = _one(work, i, work / "ref.safetensors")
            runs.append(r)
            print(
                f"run {i + 1:>2}: {'recovered' if r['recovered'] else 'FAILED'}  "
                f"detect {r['detect_s'] or float('nan'):.3f} s  restart "
                f"{r['restart_s'] or float('nan'):.2f} s  training again "
                f"{r['training_again_s'] or float('nan'):.2f} s  steps redone "
                f"{r['steps_redone']}",
                flush=True,
            )
    ok = [r for r in runs if r["recovered"]]
    summary: dict[str, Any] = {
        "recovered": len(ok),
        "runs": len(runs),
        "success_rate": len(ok) / len(runs),
    }
    for key in ("detect_s", "restart_s", "training_again_s"):
        vals = [r[key] for r in ok if r[key] is not None]
        if vals:
            summary[key] = {
                "p50": statistics.median(vals),
                "p95": _pct(vals, 0.95),
                "max": max(vals),
            }
    summary["steps_redone"] = sorted({r["steps_redone"] for r in ok})
    result = {
        "benchmark": "restart_recovery",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "script": "tests/launch_scripts/train_resume.py",
            "ranks": 2,
            "strategy": "zero-2",
            "steps": STEPS,
            "checkpoint_every": 2,
            "kill": f"rank 1 SIGKILL after step {KILL_AT}, first attempt only",
            "max_restarts": 1,
        },
        "summary": summary,
        "runs": runs,
        "versions": versions(),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{len(ok)} of {len(runs)} recovered bit-identically; "
        + ", ".join(
            f"{k} p50 {v['p50']:.3f} p95 {v['p95']:.3f}"
            for k, v in summary.items()
            if isinstance(v, dict)
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
