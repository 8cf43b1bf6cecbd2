"""Step time of ``replicate`` with its buckets spread over 1, 2 or 4 process groups
(``comm.groups``) and with the hierarchical all-reduce (``comm.hierarchical``) on and off.

Every side trains the reference GPT (:func:`longboat.models.reference_gpt`) with AdamW, on the
same ranks, in the same run, built from the same seed and fed the same batches. The sides'
steps alternate (round r rotates the order of the sides and reverses it every other round), so
a slow drift of the machine lands on every side alike. Each rank times its own step with
``time.perf_counter``; the ranks then all-reduce the MAX, the step time a synchronous job sees
(outside the timed region). The hierarchical side pretends nodes of ``--ranks-per-node`` ranks
(``comm.ranks_per_node``): at 4 ranks, 2 nodes x 2.

What to expect is in docs/communicators.md: on one machine over loopback there is no slow
inter-node link to spare and no second NIC to fill, so neither is expected to help here.

Usage::

    python benchmarks/comm_groups.py                         # 4 ranks, writes results JSON
    python benchmarks/comm_groups.py --steps 1 --tiny        # a smoke run (no measurement)

Writes ``benchmarks/results/comm_groups.json`` (``--out`` to change) with medians, ratios to
``groups1`` and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

from longboat.models import GPT, gpt_loss, reference_gpt, synthetic_tokens

#: side name -> the comm section it runs with
SIDES: dict[str, dict[str, Any]] = {
    "groups1": {"groups": 1},
    "groups2": {"groups": 2},
    "groups4": {"groups": 4},
    "hierarchical": {"hierarchical": True},
}
BASELINE = "groups1"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "comm_groups.json"

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="number of ranks (processes)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="pretend nodes of this many")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side, first")
    p.add_argument("--rounds", type=int, default=10, help="measured rounds (each runs all sides)")
    p.add_argument("--steps-per-round", type=int, default=1, help="steps per side per round")
    p.add_argument("--steps", type=int, default=None, help="smoke run: this many steps per side")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT instead (smoke runs)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help=f"results JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.steps is not None:  # a smoke run: every side steps, nothing is worth comparing
        args.warmup, args.rounds, args.steps_per_round = 0, 1, args.steps
    elif args.rounds * args.steps_per_round < 5:
        p.error("--rounds x --steps-per-round must give at least 5 measured steps per side")
    if args.world_size % args.ranks_per_node:
        p.error(f"--ranks-per-node {args.ranks_per_node} must divide --world-size")
    return args


def _model(args: argparse.Namespace) -> GPT:
    if args.tiny:
        return GPT(vocab_size=256, d_model=32, n_layers=2, n_heads=2, seq_len=16, tie_weights=False)
    return reference_gpt()


def _make(model: GPT, args: argparse.Namespace, comm: dict[str, Any]) -> StepFn:
    import longboat

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine = longboat.initialize(
        model,
        opt,
        config={
            "strategy": "replicate",
            "batch": {"micro_batch_size": args.micro_batch},
            "replicate": {"bucket_mb": args.bucket_mb},
            "comm": {**comm, "ranks_per_node": args.ranks_per_node},
            "log": {"progress": False},
        },
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = gpt_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _timed_step(step: StepFn, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Run one step; return (max over ranks of its wall time, this rank's loss)."""
    t0 = time.perf_counter()
    loss = step(*batch)
    elapsed = time.perf_counter() - t0
    t = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item(), loss.item()


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    join_loopback(rank, args.world_size, port, args.threads)
    try:
        _run(rank, args)
    finally:
        dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace) -> None:
    sides = tuple(SIDES)
    models: dict[str, GPT] = {}
    steps: dict[str, StepFn] = {}
    gens: dict[str, torch.Generator] = {}
    for name in sides:
        # The same seed for every side: identical weights and batches, the same arithmetic.
        torch.manual_seed(args.seed)
        models[name] = _model(args)
        steps[name] = _make(models[name], args, SIDES[name])
        gens[name] = torch.Generator().manual_seed(args.seed * 1000 + rank)
    model = models[sides[0]]
    samples: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, list[float]] = {name: [] for name in sides}

    def run_side(name: str, n: int, measure: bool) -> None:
        for _ in range(n):
            # Data is drawn before the clock starts: we time training, not the RNG.
            batch = synthetic_tokens(args.micro_batch, model.seq_len, model.vocab_size, gens[name])
            dt, loss = _timed_step(steps[name], batch)
            losses[name].append(loss)
            if measure:
                samples[name].append(dt)

    for name in sides:
        run_side(name, args.warmup, measure=False)
    for r in range(args.rounds):
        rot = sides[r % len(sides) :] + sides[: r % len(sides)]
        for name in rot if r % 2 == 0 else tuple(reversed(rot)):
            run_side(name, args.steps_per_round, measure=True)

    # Sanity: every side trained the same thing (sums in another order differ in the last bits).
    param_diff = max(
        (pa.detach() - pb.detach()).abs().max().item()
        for other in sides[1:]
        for pa, pb in zip(model.parameters(), models[other].parameters(), strict=True)
    )
    if rank == 0:
        _report(args, sides, model, samples, losses, param_diff)


def _report(
    args: argparse.Namespace,
    sides: tuple[str, ...],
    model: GPT,
    samples: dict[str, list[float]],
    losses: dict[str, list[float]],
    param_diff: float,
) -> None:
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = samples[BASELINE]
    ratios = {f"{n}/{BASELINE}": medians[n] / medians[BASELINE] for n in sides if n != BASELINE}
    # Sample i of each side ran in the same round: the per-round ratio cancels load that other
    # processes put on the machine for a few seconds.
    paired = {
        f"{n}/{BASELINE}": statistics.median(a / b for a, b in zip(samples[n], base, strict=True))
        for n in sides
        if n != BASELINE
    }
    n_params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {
        "benchmark": "comm_groups",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "smoke": args.steps is not None,
        "sides": {name: SIDES[name] for name in sides},
        "medians_s": medians,
        "ratios": ratios,
        "paired_ratio_medians": paired,
        "samples_s": samples,
        "losses": losses,
        "max_abs_param_diff": param_diff,
        "config": {
            "model": {
                "name": "tiny GPT" if args.tiny else "reference_gpt",
                "vocab_size": model.vocab_size,
                "d_model": model.d_model,
                "n_layers": model.n_layers,
                "n_heads": model.n_heads,
                "seq_len": model.seq_len,
                "parameters": n_params,
            },
            "optimizer": {"type": "AdamW", "lr": args.lr},
            "micro_batch": args.micro_batch,
            "world_size": args.world_size,
            "ranks_per_node": args.ranks_per_node,
            "threads_per_rank": args.threads,
            "bucket_mb": args.bucket_mb,
            "warmup_steps_per_side": args.warmup,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "order": "sides rotate every round, reversed every other round",
            "timing": "perf_counter per step per rank, all_reduce MAX over ranks",
            "backend": "gloo",
            "seed": args.seed,
        },
        "versions": versions(),
        "machine": machine(),
    }
    out = args.out or (DEFAULT_OUT.with_suffix(".smoke.json") if args.steps else DEFAULT_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'tiny GPT' if args.tiny else 'reference GPT'} {n_params:,} params, "
        f"{args.world_size} ranks ({args.ranks_per_node} per pretend node), "
        f"bucket {args.bucket_mb:g} MB"
    )
    for name in sides:
        s = samples[name]
        print(f"{name:<14} median {medians[name]:.4f} s  min {min(s):.4f}  max {max(s):.4f}")
    for key, value in ratios.items():
        print(f"ratio {key} = {value:.3f} (median of per-round ratios {paired[key]:.3f})")
    print(f"max |param difference| between sides = {param_diff:.3g}")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    """Spawn the ranks, measure, and let rank 0 write the report."""
    args = _parse_args(argv)
    port = free_port()
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(args, port), nprocs=args.world_size, join=True)
    print(f"total wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
