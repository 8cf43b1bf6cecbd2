"""gloo's all-gather and reduce-scatter at two ranks against the doorway's, which exchange chunks
with an all-to-all ([Note: gloo all-gather of two], [Note: gloo reduce-scatter of two] in
``src/longboat/comm/works.py``).

Per operation, sides move the same tensors in one pair (or group) of gloo ranks on loopback,
alternating every round (the order reversed every other round), ``--rounds`` rounds after 2
warm-up rounds:

- all-gather: ``gloo`` (``torch.distributed.all_gather_into_tensor``), ``all_to_all`` (the bare
  exchange of the note, two ranks only) and ``doorway`` (longboat's ``Collectives.all_gather``
  at its defaults, the desync check on);
- reduce-scatter: ``gloo`` (``reduce_scatter_tensor``: gloo all-reduces a copy of the input),
  ``all_reduce`` (the in-place all-reduce the doorway used for a scratch input before) and
  ``doorway`` (``Collectives.reduce_scatter`` with ``scratch=True``, as ZeRO-2/3 call it).

Each rank times a side from a barrier to the end of the wait; the max over ranks of the median is
reported, with ratios to ``gloo``. Sizes are ZeRO-3 units of the reference GPT (a block: 3.15M
fp32 parameters, 12.6 MB whole) and of a larger model.

Usage::

    python benchmarks/gloo_two_ranks.py                      # 2 ranks, about two minutes
    python benchmarks/gloo_two_ranks.py --world-size 4       # gloo's own at 4: for reference

Writes ``benchmarks/results/gloo_two_ranks.json`` (``--world-size 2``; ``--out`` to change).
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

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gloo_two_ranks.json"
SIZES = {"reference GPT block (12.6 MB)": 3_150_336, "d_model 2048 block (201 MB)": 50_356_224}


def _timed(sides: dict[str, Any], rounds: int, reset: Any = None) -> dict[str, Any]:
    """Each side's median seconds (max over ranks) in alternating rounds, and ratios to gloo;
    ``reset()`` before each timed call, outside the timing."""
    samples: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    for r in range(rounds + 2):
        for name in order if r % 2 == 0 else reversed(order):
            if reset is not None:
                reset()
            dist.barrier()
            t = time.perf_counter()
            sides[name]()
            if r >= 2:
                samples[name].append(time.perf_counter() - t)
    mine = torch.tensor([statistics.median(samples[k]) for k in sides], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    medians = dict(zip(sides, mine.tolist(), strict=True))
    return {
        "median_s": medians,
        "ratio_to_gloo": {k: v / medians["gloo"] for k, v in medians.items()},
    }


def _gathers(numel: int, rank: int, n: int, comm: Any, rounds: int) -> dict[str, Any]:
    """Every all-gather side on one size: checked, then timed."""
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
    return {"numel": numel, "output_bytes": numel * 4, **_timed(sides, rounds)}


def _reductions(numel: int, rank: int, n: int, comm: Any, rounds: int) -> dict[str, Any]:
    """Every reduce-scatter side on one size: checked, then timed. Each call reduces the same
    input, restored before it outside the timing (the in-place side overwrites it)."""
    numel -= numel % n
    data = torch.arange(numel, dtype=torch.float32) % 7 + rank
    given = data.clone()
    output = torch.empty(numel // n)

    def gloo() -> None:
        dist.reduce_scatter_tensor(output, given)

    def all_reduce() -> None:
        dist.all_reduce(given)
        output.copy_(given.chunk(n)[rank])

    def doorway() -> None:
        comm.reduce_scatter(output, given, scratch=True)

    sides = {"gloo": gloo, "all_reduce": all_reduce, "doorway": doorway}
    want = sum(torch.arange(numel, dtype=torch.float32) % 7 + r for r in range(n)).chunk(n)[rank]
    for name, fn in sides.items():  # every side reduces right
        given.copy_(data)
        output.zero_()
        fn()
        assert torch.equal(output, want), name

    return {
        "numel": numel,
        "input_bytes": numel * 4,
        **_timed(sides, rounds, reset=lambda: given.copy_(data)),
    }


def _job(rank: int, args: dict[str, Any], port: int, out: str) -> None:
    from longboat.comm.collectives import Collectives

    n = args["world_size"]
    join_loopback(rank, n, port, threads=1)
    comm = Collectives(timeout_s=120)  # the defaults: desync check on
    rounds = args["rounds"]
    results = {
        "all_gather": {label: _gathers(m, rank, n, comm, rounds) for label, m in SIZES.items()},
        "reduce_scatter": {
            label: _reductions(m, rank, n, comm, rounds) for label, m in SIZES.items()
        },
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
        "benchmark": "gloo_two_ranks",
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
    for op, by_size in results.items():
        for label, r in by_size.items():
            line = ", ".join(
                f"{k} {v * 1e3:.2f} ms ({r['ratio_to_gloo'][k]:.2f}x)"
                for k, v in r["median_s"].items()
            )
            print(f"{op}, {label}: {line}")


if __name__ == "__main__":
    main()
