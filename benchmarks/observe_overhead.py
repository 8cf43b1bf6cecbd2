"""What the desync check and the comm log cost: step time of the reference GPT at 2 ranks with
both on against both off.

One engine (``replicate`` or, with ``--strategy zero3``, ZeRO stage 3; AdamW) trains; its
doorway is built with the check and the log, and their flags are flipped before each measured
step, so both sides share the model, the buckets, the ranks and the moment. Sides alternate ABBA
(the order flips every round) so a slow drift of the machine lands on both alike. Each rank times
its step with ``time.perf_counter``; the ranks all-reduce the MAX (outside the timed region, on
torch directly so that it is never observed).

Usage::

    python benchmarks/observe_overhead.py                 # full size: 2 ranks x 1 thread
    python benchmarks/observe_overhead.py --strategy zero3   # ZeRO-3: many more collectives
    python benchmarks/observe_overhead.py --tiny --rounds 3 --warmup 2   # a smoke run

Writes ``benchmarks/results/observe_overhead.json`` (``observe_overhead_zero3.json`` for ZeRO-3;
``--out`` to change) and prints
``ratio (observed / plain) = X.XXX``, the median of the per-round ratios (each round's two steps
are taken moments apart, so their ratio cancels what the machine was doing; a ratio of two
medians pairs steps from different moments); the goal is at most 1.03.
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
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

from longboat.models import GPT, gpt_loss, reference_gpt, synthetic_tokens

SIDES = ("plain", "observed")  # observed: desync check + comm log
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "observe_overhead.json"


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps, first")
    p.add_argument("--rounds", type=int, default=20, help="measured rounds (one step per side)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--tiny", action="store_true", help="a small GPT, to check the script runs")
    p.add_argument("--strategy", choices=("replicate", "zero3"), default="replicate")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.out is None:
        suffix = "" if args.strategy == "replicate" else f"_{args.strategy}"
        args.out = DEFAULT_OUT.with_name(f"observe_overhead{suffix}.json")
    return args


def _strategy(args: argparse.Namespace) -> dict[str, Any]:
    if args.strategy == "zero3":
        return {"strategy": "zero", "zero": {"stage": 3}}
    return {"strategy": "replicate"}


def _model(args: argparse.Namespace) -> GPT:
    if args.tiny:
        return GPT(
            vocab_size=256,
            d_model=32,
            n_layers=1,
            n_heads=2,
            seq_len=args.seq_len,
            tie_weights=False,
        )
    return reference_gpt()


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    join_loopback(rank, args.world_size, port, args.threads)
    try:
        _run(rank, args)
    finally:
        dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace) -> None:
    import longboat

    torch.manual_seed(0)
    model = _model(args)
    engine = longboat.initialize(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        config={
            **_strategy(args),
            "batch": {"micro_batch_size": args.micro_batch},
            "comm": {"desync_check": True, "log": True},
            "log": {"progress": False},
        },
    )
    comm = engine.comm
    gen = torch.Generator().manual_seed(1000 + rank)
    samples: dict[str, list[float]] = {s: [] for s in SIDES}

    def step(side: str, measure: bool) -> None:
        comm.desync_check = comm.log = side == "observed"
        x, y = synthetic_tokens(args.micro_batch, args.seq_len, model.vocab_size, gen)
        t0 = time.perf_counter()
        engine.backward(gpt_loss(engine(x), y))
        engine.step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if measure:
            samples[side].append(t.item())

    for i in range(args.warmup):
        step(SIDES[i % 2], measure=False)
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            step(side, measure=True)
    comm.log = True
    summary = comm.log_summary()
    engine.close()
    if rank == 0:
        _report(args, model, samples, summary)


def _report(
    args: argparse.Namespace,
    model: GPT,
    samples: dict[str, list[float]],
    comm_log: list[dict[str, Any]],
) -> None:
    medians = {s: statistics.median(v) for s, v in samples.items()}
    of_medians = medians["observed"] / medians["plain"]
    paired = statistics.median(
        a / b for a, b in zip(samples["observed"], samples["plain"], strict=True)
    )
    result = {
        "benchmark": "observe_overhead",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # The headline: the median of the per-round (paired) ratios.
        "medians_s": medians,
        "ratio": paired,
        "ratio_of_medians": of_medians,
        "goal": 1.03,
        "samples_s": samples,
        "comm_log_observed_steps": comm_log,
        "config": {
            "model": "tiny GPT" if args.tiny else "reference_gpt",
            "parameters": sum(p.numel() for p in model.parameters()),
            "micro_batch": args.micro_batch,
            "seq_len": args.seq_len,
            "world_size": args.world_size,
            "threads_per_rank": args.threads,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "strategy": _strategy(args),
            "optimizer": "AdamW",
            "order": "ABBA, one step per side per round",
            "observed": "comm.desync_check and comm.log on",
            "backend": "gloo",
        },
        "versions": versions(),
        "machine": machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for s in SIDES:
        v = samples[s]
        print(
            f"{s:<9} median {medians[s]:.4f} s  min {min(v):.4f}  max {max(v):.4f} ({len(v)} steps)"
        )
    print(f"ratio of the medians = {of_medians:.3f}")
    print(f"ratio (observed / plain) = {paired:.3f}  (median of per-round ratios; goal <= 1.03)")
    print(f"wrote {args.out}")


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    mp.spawn(_worker, args=(args, free_port()), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
