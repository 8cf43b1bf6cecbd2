"""gloo's all-gather against an all-to-all moving the same bytes, and the doorway's all-gather.

At two ranks an all-gather is an all-to-all in which each rank sends its shard to the other
([Note: gloo all-gather of two] in ``src/longboat/comm/works.py``). Three sides gather the same
shard into the same output, in one pair (or group) of gloo ranks on loopback, alternating every
round (the order reversed every other round), ``--rounds`` rounds after 2 warm-up rounds:

- ``gloo``: ``torch.distributed.all_gather_into_tensor``, gloo's own;
- ``all_to_all``: ``torch.distributed.all_to_all_single`` with the splits of the note (two ranks
  only);
- ``doorway``: longboat's ``Collectives.all_gather`` at its defaults (the desync check on), which
  takes the all-to-all at two ranks and gloo's own at more.

Each rank times a side from a barrier to the end of the wait; the max over ranks of the median is
reported, with ratios to ``gloo``. Sizes are ZeRO-3 units of the reference GPT (a block: 3.15M
fp32 parameters, 12.6 MB gathered) and of a larger model.

Usage::

    python benchmarks/gloo_all_gather.py                      # 2 ranks, about a minute
    python benchmarks/gloo_all_gather.py --world-size 4       # gloo's own at 4: for reference

Writes ``benchmarks/results/gloo_all_gather.json`` (``--world-size 2``; ``--out`` to change).
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
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fresh_job, join_loopback, machine, versions

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gloo_all_gather.json"
SIZES = {"reference GPT block (12.6 MB)": 3_150_336, "d_model 2048 block (201 MB)": 50_356_224}


def _measure(numel: int, rank: int, n: int, comm: Any, rounds: int) -> dict[str, Any]:
    """Every side on one size: checked, then timed in alternating rounds."""
    numel -= numel % n
    shard = torch.full((numel // n,), float(rank))
    output = torch.empty(numel)
    peer, s = 1 - rank, numel // n

    def gloo() -> None:
        dist.all_gather_into_tensor(output, shard)

    def all_to_all() -> None:
        output[rank * s : (rank + 1) * s].copy_(shard)
        splits = [0, 0]
        splits[peer] = s
        dist.all_to_all_single(
            output[peer * s : (peer + 1) * s],
            shard,
            output_split_sizes=splits,
            input_split_sizes=splits,
        )

    def doorway() -> None:
        comm.all_gather(output, shard)

    sides = {"gloo": gloo, "doorway": doorway}
    if n == 2:
        sides["all_to_all"] = all_to_all
    want = torch.cat([torch.full((s,), float(r)) for r in range(n)])
    for name, fn in sides.items():  # every side gathers right
        output.zero_()
        fn()
        assert torch.equal(output, want), name
    samples: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    for r in range(rounds + 2):
        for name in order if r % 2 == 0 else reversed(order):
            dist.barrier()
            t = time.perf_counter()
            sides[name]()
            if r >= 2:
                samples[name].append(time.perf_counter() - t)
    mine = torch.tensor([statistics.median(samples[k]) for k in sides], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    medians = dict(zip(sides, mine.tolist(), strict=True))
    return {
        "numel": numel,
        "output_bytes": numel * 4,
        "median_s": medians,
        "ratio_to_gloo": {k: v / medians["gloo"] for k, v in medians.items()},
    }


def _job(rank: int, args: dict[str, Any], port: int, out: str) -> None:
    from longboat.comm.collectives import Collectives

    n = args["world_size"]
    join_loopback(rank, n, port, threads=1)
    comm = Collectives(timeout_s=120)  # the defaults: desync check on
    results = {
        label: _measure(numel, rank, n, comm, args["rounds"]) for label, numel in SIZES.items()
    }
    comm.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15, help="measured rounds of every side")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    args = {"world_size": a.world_size, "rounds": a.rounds}
    started = time.monotonic()
    results = fresh_job(_job, a.world_size, args)
    record = {
        "benchmark": "gloo_all_gather",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {**args, "threads_per_rank": 1, "backend": "gloo", "dtype": "float32"},
        "results": results,
        "wall_time_s": time.monotonic() - started,
        "versions": versions(),
        "machine": machine(),
    }
    out = a.out or (DEFAULT_OUT if a.world_size == 2 else None)
    text = json.dumps(record, indent=1)
    if out is not None:
        out.write_text(text + "\n")
    for label, r in results.items():
        line = ", ".join(
            f"{k} {v * 1e3:.2f} ms ({r['ratio_to_gloo'][k]:.2f}x)" for k, v in r["median_s"].items()
        )
        print(f"{label}: {line}")


if __name__ == "__main__":
    main()
