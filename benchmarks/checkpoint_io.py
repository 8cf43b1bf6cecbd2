"""Checkpoint save and load throughput beside the disk's own, measured in the same run.

Two ranks train the reference GPT (:func:`longboat.models.reference_gpt`, 21,064,704 parameters)
with AdamW for one step, so the optimizer holds its two moments; then, alternating, for each
strategy asked for:

- ``save``: ``engine.save_checkpoint`` (tensors streamed to safetensors with a SHA-256 per file
  and per tensor, JSON state, manifest, fsync, atomic rename, ``latest`` moved);
- ``load``: ``engine.load_checkpoint`` (every file hashed and checked, then each rank reads the
  slices its layout owns);
- ``plain write``: each rank writes its share of the same number of bytes to one file, flushed
  and fsync'd: the disk's bandwidth as a script without checkpoints would see it;
- ``plain read``: each rank reads that file back.

Each operation is timed per rank between two barriers and reported as the slowest rank's time;
GB/s = checkpoint bytes (all files) / that time. Reads come from the page cache on both sides
alike (the files were just written; nothing is dropped). Median of ``--repeats`` rounds.

Usage::

    python benchmarks/checkpoint_io.py                      # replicate and zero-3 at 2 ranks
    python benchmarks/checkpoint_io.py --strategies zero2 --repeats 3

Writes ``benchmarks/results/checkpoint_io.json`` (``--out`` to change) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "checkpoint_io.json"
STRATEGIES = {
    "replicate": {"strategy": "replicate"},
    "zero1": {"strategy": "zero", "zero": {"stage": 1}},
    "zero2": {"strategy": "zero", "zero": {"stage": 2}},
    "zero3": {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["_Block"]}},
}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--strategies",
        default="replicate,zero3",
        help=f"comma-separated, from {', '.join(STRATEGIES)}",
    )
    p.add_argument("--repeats", type=int, default=5, help="measured rounds per strategy")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to write (default: a temporary directory, removed afterwards)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    args.strategies = args.strategies.split(",")
    for s in args.strategies:
        if s not in STRATEGIES:
            p.error(f"--strategies: unknown {s!r}; choose from {', '.join(STRATEGIES)}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def _timed(fn: Any) -> float:
    """Seconds of ``fn()`` on the slowest rank (barriers before and after)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    dist.barrier()
    return float(dt.item())


def _plain_write(path: Path, nbytes: int) -> None:
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _plain_read(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(8 << 20):
            pass


def _checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _measure(
    rank: int, world: int, args: argparse.Namespace, name: str, root: Path
) -> dict[str, Any]:
    import longboat
    from longboat.models import gpt_loss, reference_gpt, synthetic_tokens

    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = {
        **STRATEGIES[name],
        "batch": {"micro_batch_size": 2},
        "log": {"progress": False, "level": "WARNING"},
    }
    engine = longboat.initialize(model, opt, cfg)
    x, y = synthetic_tokens(2, 128, model.vocab_size, torch.Generator().manual_seed(rank))
    engine.backward(gpt_loss(engine(x), y))
    engine.step()  # AdamW now holds exp_avg and exp_avg_sq
    ckdir = root / name
    plain = root / f"plain-{name}-{rank}.bin"
    times: dict[str, list[float]] = {"save": [], "load": [], "plain_write": [], "plain_read": []}
    nbytes = 0
    for r in range(args.repeats + 1):  # round 0 warms up (allocations, page cache, imports)
        tag = f"r{r}"
        t_save = _timed(lambda tag=tag: engine.save_checkpoint(ckdir, tag=tag))
        nbytes = _checkpoint_bytes(ckdir / tag)
        share = -(-nbytes // world)
        t_write = _timed(lambda share=share: _plain_write(plain, share))
        t_load = _timed(lambda tag=tag: engine.load_checkpoint(ckdir, tag))
        t_read = _timed(lambda: _plain_read(plain))
        if rank == 0 and r > 0:
            shutil.rmtree(ckdir / f"r{r - 1}", ignore_errors=True)  # keep the disk use small
        if r == 0:
            continue
        for key, t in (
            ("save", t_save),
            ("plain_write", t_write),
            ("load", t_load),
            ("plain_read", t_read),
        ):
            times[key].append(t)
    engine.close()
    plain.unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "checkpoint_bytes": nbytes,
        "times_s": times,
        "median_s": med,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
        "parameters": sum(p.numel() for p in reference_gpt().parameters()),
    }


def _worker(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    join_loopback(rank, args.world_size, port, args.threads)
    try:
        results = {s: _measure(rank, args.world_size, args, s, Path(root)) for s in args.strategies}
        if rank == 0:
            _report(args, results)
    finally:
        dist.destroy_process_group()


def _report(args: argparse.Namespace, results: dict[str, Any]) -> None:
    out = {
        "benchmark": "checkpoint_io",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {
            "model": "reference_gpt",
            "optimizer": "AdamW (one step taken)",
            "world_size": args.world_size,
            "threads_per_rank": args.threads,
            "repeats": args.repeats,
            "warmup_rounds": 1,
            "timing": "per rank between barriers, MAX over ranks; median of repeats",
            "reads": "page cache warm for load and plain read alike",
        },
        "results": results,
        "versions": versions(),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"reference GPT + AdamW at {args.world_size} ranks; median of {args.repeats}")
    print(
        f"{'strategy':<10} {'bytes':>13} {'save GB/s':>10} {'plain write':>12} "
        f"{'load GB/s':>10} {'plain read':>11}"
    )
    for name, r in results.items():
        g = r["gb_per_s"]
        print(
            f"{name:<10} {r['checkpoint_bytes']:>13,} {g['save']:>10.2f} "
            f"{g['plain_write']:>12.2f} {g['load']:>10.2f} {g['plain_read']:>11.2f}"
        )
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="longboat-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        mp.spawn(_worker, args=(args, free_port(), str(root)), nprocs=args.world_size, join=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
