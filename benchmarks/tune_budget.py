"""Does ``longboat tune`` keep its ``--time``? The command as a user runs it, on the tiny GPT
with ``--time 60s`` and every other flag at its default but the sequence (``--world-size 2``,
the whole default search space; ``--seq-len 32``, the tiny GPT's longest): its wall time from
the shell, the time of each phase it reports, how many candidates it planned, measured and left
out for time, its choice and its exit status.

Before planning kept to its share of the time ([Note: tune phases] in
``longboat/tune/search.py``), this run spent 84 s planning 56 candidates, measured none and
exited 1.

Usage::

    python benchmarks/tune_budget.py            # about a minute; nothing else running

Writes ``benchmarks/results/tune_budget.json`` with the command, versions and machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, versions

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gpt")
    p.add_argument("--time", default="60s")
    p.add_argument("--seq-len", default="32", help="the tiny GPT's longest (tune's default is 128)")
    p.add_argument("--out", type=Path, default=RESULTS / "tune_budget.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tune-budget-") as tmp:
        cmd = [sys.executable, "-m", "longboat.cli", "tune", "--model", args.model]
        cmd += ["--seq-len", args.seq_len]
        cmd += ["--time", args.time, "--json", "--out", str(Path(tmp, "tuned.toml"))]
        load_before = os.getloadavg()
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        sys.exit(f"tune printed no JSON (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    outcomes = report.get("candidates", [])
    unplanned = sum(1 for o in outcomes if str(o.get("reason", "")).startswith("time: not planned"))
    result = {
        "benchmark": "tune_budget",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": ["longboat", *cmd[3:-2]],
        "exit_status": proc.returncode,
        "wall_time_s": wall,
        "time_budget": args.time,
        "phases_s": report.get("phases_s"),
        "candidates": len(outcomes),
        "by_status": report.get("counts"),
        "not_planned_for_time": unplanned,
        "winner": report.get("winner"),
        "reason": report.get("reason"),
        "load_average_before_after": [load_before, load_after],
        "versions": versions(),
        "machine": machine(),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in list(result)[:12]}, indent=2))


if __name__ == "__main__":
    main()
