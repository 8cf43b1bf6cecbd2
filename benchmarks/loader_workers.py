"""The loader with worker processes against without, on a dataset whose items cost time.

Each item of the dataset takes ``--item-ms`` to produce (a sleep: the cost of reading and
decoding a file, which leaves the CPU free, as most data loading does), so a batch of 32 costs
32 x item-ms in the training process without workers. With ``data.num_workers`` worker processes
prefetching (``data.prefetch_factor``), that cost moves off the training process and overlaps the
step. One process trains the digits CNN (``single``) for ``--steps`` steps per round under each
setting, the settings interleaved round by round; reported per setting: the median over rounds of
the step time and of the profiler's ``data`` column (``profile.wall_clock_breakdown``: the time
the step waited for its batch), and each setting's speed-up over ``workers=0`` (median of per-round
ratios).

Usage::

    python benchmarks/loader_workers.py                  # 60 steps x 5 rounds
    python benchmarks/loader_workers.py --steps 20 --repeats 1

Writes ``benchmarks/results/loader_workers.json`` (``--out`` to change) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import machine, versions
from torch.utils.data import Dataset

import longboat
from longboat.models import DigitsCNN

SETTINGS: dict[str, dict[str, Any]] = {
    "workers=0": {},
    "workers=2": {"num_workers": 2},
    "workers=2 persistent": {"num_workers": 2, "persistent_workers": True},
    "workers=4 prefetch=4": {"num_workers": 4, "prefetch_factor": 4},
}
BATCH = 32


class SlowDigits(Dataset):
    """Random 8x8 images whose every item takes ``item_s`` to produce."""

    def __init__(self, n: int, item_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 1, 8, 8, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.item_s = item_s

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.item_s)
        return self.x[i], self.y[i]


def one_round(setting: dict[str, Any], steps: int, item_s: float) -> dict[str, float]:
    """Train ``steps`` steps (after one warm-up step); wall time and data wait per step."""
    torch.manual_seed(0)
    model = DigitsCNN()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        {
            "log": {"level": "WARNING", "progress": False},
            "batch": {"micro_batch_size": BATCH},
            "data": setting,
            "profile": {"wall_clock_breakdown": True},
        },
    )
    loader = engine.loader(SlowDigits(BATCH * (steps + 1), item_s))
    t0 = 0.0
    for i, (x, y) in enumerate(loader):
        if i == 1:
            t0 = time.perf_counter()  # after the warm-up step (workers start, first batches)
        engine.backward(F.cross_entropy(engine(x), y))
        engine.step()
    wall = time.perf_counter() - t0
    data = engine.monitor.phase_totals["data"]  # the warm-up step is kept apart from these
    engine.close()
    return {"step_ms": 1e3 * wall / steps, "data_ms": 1e3 * data / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--item-ms", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).with_name("results") / "loader_workers.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for r in range(args.repeats):
        for name, setting in SETTINGS.items():
            rounds[name].append(one_round(setting, args.steps, args.item_ms / 1e3))
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(
            f"{n} {rounds[n][-1]['step_ms']:.1f} ms" for n in SETTINGS), flush=True)  # fmt: skip

    base = rounds["workers=0"]
    results = {}
    for name, rs in rounds.items():
        results[name] = {
            "setting": SETTINGS[name],
            "step_ms_median": statistics.median(x["step_ms"] for x in rs),
            "data_ms_median": statistics.median(x["data_ms"] for x in rs),
            "speedup_vs_workers0_median": statistics.median(
                b["step_ms"] / x["step_ms"] for b, x in zip(base, rs, strict=True)
            ),
            "rounds": rs,
        }
    out = {
        "benchmark": "loader_workers",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "steps": args.steps,
            "repeats": args.repeats,
            "item_ms": args.item_ms,
            "batch": BATCH,
            "batch_cost_ms": BATCH * args.item_ms,
            "threads": args.threads,
            "model": "DigitsCNN, strategy single, SGD",
        },
        "versions": versions(),
        "machine": machine(),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{'setting':<22} {'step ms':>9} {'data ms':>9} {'speed-up':>9}")
    for name, res in results.items():
        print(
            f"{name:<22} {res['step_ms_median']:>9.2f} {res['data_ms_median']:>9.2f} "
            f"{res['speedup_vs_workers0_median']:>8.2f}x"
        )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
