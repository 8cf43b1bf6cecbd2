"""What diagnostics cost: the same training at 2 ranks with monitors and the profiler off and on.

Each rank trains the digits CNN (:class:`longboat.models.DigitsCNN`, replicate) on random 8x8
images for ``--steps`` steps per round under each setting, the settings interleaved round by
round so that drift in the machine's load hits all alike:

- ``off``: no console, no files, no profiling (the hooks return at once);
- ``console``: the default console, piped (an event every 50 steps);
- ``csv+tb``: CSV and TensorBoard every step, plus the console;
- ``breakdown``: ``profile.wall_clock_breakdown`` with CSV every step;
- ``all``: breakdown and flops, CSV and TensorBoard every step;
- ``off-nocheck`` and ``csv+tb-nocheck``: ``off`` and ``csv+tb`` with ``comm.desync_check``
  off, the second measured against the first: what the event costs without the check in front
  of its all-gather (the check is a blocking round trip, so it makes the ranks wait for each
  other once more per event).

A round's time is the slowest rank's wall time over its steps (after ``--warmup`` steps), one
all-reduce MAX outside the timed region; the report is the median over ``--repeats`` rounds and
each setting's overhead against its baseline, ``off`` or ``off-nocheck`` (median of per-round
ratios). The goal is <= 3%.

Usage::

    python benchmarks/monitor_overhead.py                        # 200 steps x 5 rounds
    python benchmarks/monitor_overhead.py --steps 20 --repeats 1 # a quick check

Writes ``benchmarks/results/monitor_overhead.json`` (``--out`` to change) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

QUIET = {"level": "WARNING"}
SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"log": {**QUIET, "progress": False}},
    "console": {"log": QUIET},
    "csv+tb": {
        "log": QUIET,
        "monitor": {"csv": {"enabled": True}, "tensorboard": {"enabled": True}},
    },
    "breakdown": {
        "log": QUIET,
        "monitor": {"csv": {"enabled": True}},
        "profile": {"wall_clock_breakdown": True},
    },
    "all": {
        "log": QUIET,
        "monitor": {"csv": {"enabled": True}, "tensorboard": {"enabled": True}},
        "profile": {"wall_clock_breakdown": True, "flops": True},
    },
}
NOCHECK = {"comm": {"desync_check": False}}
SETTINGS["off-nocheck"] = {**SETTINGS["off"], **NOCHECK}
SETTINGS["csv+tb-nocheck"] = {**SETTINGS["csv+tb"], **NOCHECK}


def baseline(name: str) -> str:
    """The setting ``name`` is measured against."""
    return "off-nocheck" if name.endswith("-nocheck") else "off"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--out", default=str(Path(__file__).with_name("results") / "monitor_overhead.json")
    )
    return p.parse_args(argv)


def _round(name: str, args: argparse.Namespace, workdir: str, r: int) -> float:
    import longboat
    from longboat.models import DigitsCNN

    torch.manual_seed(0)
    model = DigitsCNN()
    cfg = json.loads(json.dumps(SETTINGS[name]))  # a copy to fill in
    for sink in ("csv", "tensorboard"):
        if sink in cfg.get("monitor", {}):
            cfg["monitor"][sink].update(output_path=workdir, job_name=f"{name}-{r}")
    cfg.update(batch={"train_batch_size": args.batch}, strategy="replicate")
    engine = longboat.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    n = args.batch * (args.steps + args.warmup)
    data = torch.utils.data.TensorDataset(torch.rand(n, 1, 8, 8), torch.randint(0, 10, (n,)))
    loss_fn = torch.nn.CrossEntropyLoss()
    t0 = 0.0
    for i, (x, y) in enumerate(engine.loader(data, shuffle=False)):
        if i == args.warmup:
            t0 = time.perf_counter()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    engine.close()
    return float(took) / args.steps


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    join_loopback(rank, 2, port, args.threads)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            box = [tmp]
            dist.broadcast_object_list(box)  # one directory for rank 0's files
            times: dict[str, list[float]] = {k: [] for k in SETTINGS}
            for r in range(args.repeats):
                for name in SETTINGS:
                    times[name].append(_round(name, args, box[0], r))
            if rank == 0:
                _report(args, times)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    rows = {}
    for name, ts in times.items():
        base = baseline(name)
        ratio = statistics.median(t / o for t, o in zip(ts, times[base], strict=True))
        rows[name] = {
            "median_step_ms": statistics.median(ts) * 1e3,
            "baseline": base,
            "overhead": ratio - 1,
            "rounds_ms": [t * 1e3 for t in ts],
        }
        print(
            f"{name:15s} {rows[name]['median_step_ms']:8.3f} ms/step  "
            f"{rows[name]['overhead']:+7.2%} vs {base}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "monitor_overhead",
                "date": datetime.datetime.now(datetime.UTC).isoformat(),
                "settings": SETTINGS,
                "args": vars(args),
                "results": rows,
                "versions": versions("tensorboard"),
                "machine": machine(),
                "timing": "perf_counter over the steps after warm-up, all_reduce MAX over 2 ranks",
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    """Spawn the two ranks and measure."""
    args = _parse_args(argv)
    mp.spawn(_worker, args=(args, free_port()), nprocs=2, join=True)


if __name__ == "__main__":
    main()
