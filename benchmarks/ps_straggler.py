"""A straggler against each way of waiting for it: parameter servers in ``sync``, ``ssp``
(staleness 2) and ``async`` mode, and ``replicate``, with one worker slowed 2x.

Every side trains the default example's model (``DigitsCNN``, scikit-learn digits, AdamW lr 3e-3,
no clipping) with 3 workers of 32 samples per step; the parameter-server sides add 1 server
rank (4 processes on this 2-core machine, against 3 for ``replicate``). Worker 2 is the
straggler: after each of its steps it sleeps as long as that step took, so each of its steps
takes twice as long. Each side trains for ``--budget`` seconds of wall clock: a worker stops at
its first step boundary past the budget. In ``replicate`` and ``sync`` the workers must stop at
the same step, so they agree on it (one small all-reduce on the control plane per step, on both
sides alike); in ``ssp`` and ``async`` each decides alone (there is no collective between
their workers). Then worker 0 measures, with its own parameters (the last it pulled), the loss
on the whole training set and the accuracy on the test set.

Recorded per run: each worker's steps, the job's samples per second (every worker's samples
over the budget), the loss and accuracy at the budget. Each side runs alone in fresh processes,
``--repeats`` times, the sides' order rotated each repeat; medians, and the medians of paired
ratios (each repeat's run against the same repeat's ``sync`` and ``replicate`` runs: this
machine's speed drifts between repeats by up to 2x, far more than between neighbouring runs).

Usage::

    python benchmarks/ps_straggler.py                       # ~7 minutes
    python benchmarks/ps_straggler.py --budget 5 --repeats 1   # a smoke run

Writes ``benchmarks/results/parameter_server/straggler.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "parameter_server" / "straggler.json"
WORKERS = 3
MICRO = 32
SLOW = 2  # the straggler's worker index

SIDES: dict[str, dict[str, Any]] = {
    "replicate": {"strategy": "replicate"},
    "sync": {"strategy": "parameter_server", "parameter_server": {"mode": "sync"}},
    "ssp-2": {
        "strategy": "parameter_server",
        "parameter_server": {"mode": "ssp", "staleness": 2},
    },
    "async": {"strategy": "parameter_server", "parameter_server": {"mode": "async"}},
}


def _data() -> tuple[Any, Any, Any]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import TensorDataset

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    xtr, xte, ytr, yte = train_test_split(
        x, torch.tensor(y), test_size=0.2, random_state=0, stratify=y
    )
    return TensorDataset(xtr, ytr), (xtr, ytr), (xte, yte)


def _rank(rank: int, world: int, port: int, side: str, budget: float, queue: Any) -> None:
    join_loopback(rank, world, port, threads=1)
    import longboat
    import longboat.ps
    from longboat.models import DigitsCNN

    train, whole, test = _data()
    longboat.seed_everything(0)
    model = DigitsCNN()
    cfg = {
        **SIDES[side],
        "batch": {"train_batch_size": MICRO * WORKERS},
        "data": {"remainder": "drop"},
        "log": {"progress": False, "level": "WARNING"},
    }
    try:
        engine = longboat.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cfg)
    except longboat.ps.ServerExit as served:
        queue.put((rank, {"served": served.summary}))
        return
    worker = engine.topology.coords["dp"]
    loss_fn = torch.nn.functional.cross_entropy
    start = time.perf_counter()
    done = False
    while not done:
        for x, y in engine.loader(train):
            t = time.perf_counter()
            engine.backward(loss_fn(engine(x), y))
            engine.step()
            if worker == SLOW:
                time.sleep(time.perf_counter() - t)  # twice as long a step
            flag = torch.tensor([float(time.perf_counter() - start > budget)])
            engine.control.all_reduce(flag, op="max")  # a world of one in ssp and async
            if flag.item():
                done = True
                break
    elapsed = time.perf_counter() - start
    out: dict[str, Any] = {"worker": worker, "steps": engine.global_step, "seconds": elapsed}
    if worker == 0:
        engine.eval()
        with torch.no_grad():
            out["loss"] = float(loss_fn(engine(whole[0]), whole[1]))
            out["accuracy"] = float((engine(test[0]).argmax(1) == test[1]).float().mean())
    engine.close()
    queue.put((rank, out))


def run_side(side: str, budget: float) -> dict[str, Any]:
    world = WORKERS + (1 if side != "replicate" else 0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, side, budget, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=budget * 4 + 120) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    workers = [results[r] for r in range(WORKERS)]
    steps = [w["steps"] for w in workers]
    return {
        "steps_per_worker": steps,
        "samples_per_s": sum(steps) * MICRO / budget,
        "loss": workers[0]["loss"],
        "accuracy": workers[0]["accuracy"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=8.0, help="seconds of training per run")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    names = list(SIDES)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for side in order:
            r = run_side(side, args.budget)
            runs[side].append(r)
            print(f"repeat {rep + 1} {side:9s} {json.dumps(r)}", flush=True)
    med = {
        n: {
            k: statistics.median(r[k] for r in runs[n])
            for k in ("samples_per_s", "loss", "accuracy")
        }
        for n in names
    }
    # Paired: each repeat's side against the same repeat's sync and replicate runs (the
    # machine's speed drifts between repeats far more than between neighbouring runs).
    ratios = {
        n: {
            f"samples_per_s_vs_{base}": statistics.median(
                a["samples_per_s"] / b["samples_per_s"]
                for a, b in zip(runs[n], runs[base], strict=True)
            )
            for base in ("sync", "replicate")
        }
        for n in names
    }
    result = {
        "benchmark": "ps_straggler",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "model": "DigitsCNN (default example)",
            "optimizer": "AdamW lr 3e-3",
            "workers": WORKERS,
            "servers": "1 (parameter-server sides)",
            "micro_batch": MICRO,
            "straggler": f"worker {SLOW} sleeps as long as each of its steps took (2x slower)",
            "budget_s": args.budget,
            "repeats": args.repeats,
            "stop": "replicate and sync agree on the stop step (one control all-reduce per "
            "step); ssp and async stop each worker alone",
            "command": "python benchmarks/ps_straggler.py " + " ".join(sys.argv[1:]),
        },
        "versions": versions("scikit-learn"),
        "machine": machine(),
        "runs": runs,
        "median": med,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for n in names:
        m, r = med[n], ratios[n]
        print(
            f"{n:9s} {m['samples_per_s']:8.1f} samples/s  x{r['samples_per_s_vs_sync']:.2f} vs "
            f"sync  x{r['samples_per_s_vs_replicate']:.2f} vs replicate  loss {m['loss']:.4f}  "
            f"accuracy {m['accuracy']:.4f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
