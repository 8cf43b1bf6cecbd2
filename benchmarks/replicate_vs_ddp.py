"""Step time of longboat's ``replicate`` strategy against torch's DistributedDataParallel.

Both setups train the reference GPT (:func:`longboat.models.reference_gpt`) with AdamW, on the
same ranks, in the same run, built from the same seed and fed the same batches. Their steps are
measured alternately (round r runs a few steps of one side, then of the other; the order flips
every round, ABBA, so a slow drift of the machine — thermal, page cache, a noisy neighbour —
lands on both sides equally instead of on whichever ran second).

One step is forward, loss, backward, optimizer step, zero_grad. Each rank times its own step
with ``time.perf_counter`` (no barrier inside the step: a barrier would hide the straggler), then
the ranks all-reduce the MAX of that time, which is the step time a synchronous job sees. The
all-reduce is outside the timed region.

Usage::

    python benchmarks/replicate_vs_ddp.py                # both sides, writes results JSON
    python benchmarks/replicate_vs_ddp.py --only ddp     # DDP alone (no longboat needed)

Writes ``benchmarks/results/replicate_vs_ddp.json`` (``--out`` to change) and prints
``ratio (replicate / DDP) = X.XXX``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions
from torch.nn.parallel import DistributedDataParallel

from longboat.models import GPT, gpt_loss, reference_gpt, synthetic_tokens

# "replicate_serial_opt" is replicate with the optimizer overlap off: one optimizer step after
# every all-reduce has landed, as DDP does. It shows what that overlap is worth.
SIDES = ("replicate", "ddp", "replicate_serial_opt")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "replicate_vs_ddp.json"

# A step takes a batch and returns the (detached) loss.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (processes)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size, both")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side, first")
    p.add_argument("--rounds", type=int, default=10, help="measured rounds (each runs both sides)")
    p.add_argument("--steps-per-round", type=int, default=1, help="steps per side per round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=SIDES, default=None, help="measure one side alone")
    p.add_argument("--out", type=Path, default=None, help=f"results JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.warmup < 2:
        p.error("--warmup must be at least 2 (the first steps allocate buckets and state)")
    if args.rounds * args.steps_per_round < 5:
        p.error("--rounds x --steps-per-round must give at least 5 measured steps per side")
    return args


def _make_ddp(model: GPT, args: argparse.Namespace) -> StepFn:
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = gpt_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _make_replicate(model: GPT, args: argparse.Namespace, overlap: bool = True) -> StepFn:
    import longboat

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine = longboat.initialize(
        model,
        opt,
        config={
            "strategy": "replicate",
            "batch": {"micro_batch_size": args.micro_batch},
            "replicate": {"bucket_mb": args.bucket_mb, "overlap_optimizer": overlap},
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


def _worker(rank: int, args: argparse.Namespace, port: int, sides: tuple[str, ...]) -> None:
    join_loopback(rank, args.world_size, port, args.threads)
    try:
        _run(rank, args, sides)
    finally:
        dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace, sides: tuple[str, ...]) -> None:
    makers = {
        "replicate": _make_replicate,
        "ddp": _make_ddp,
        "replicate_serial_opt": lambda m, a: _make_replicate(m, a, overlap=False),
    }
    models: dict[str, GPT] = {}
    steps: dict[str, StepFn] = {}
    gens: dict[str, torch.Generator] = {}
    for name in sides:
        # Same seed for both copies: identical weights, identical batches (the generator differs
        # per rank only), so both sides do the same arithmetic and their losses can be compared.
        torch.manual_seed(args.seed)
        models[name] = reference_gpt()
        steps[name] = makers[name](models[name], args)
        gens[name] = torch.Generator().manual_seed(args.seed * 1000 + rank)

    vocab = models[sides[0]].vocab_size
    samples: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, list[float]] = {name: [] for name in sides}

    def run_side(name: str, n: int, measure: bool) -> None:
        for _ in range(n):
            # Data is drawn before the clock starts: we time training, not the RNG.
            batch = synthetic_tokens(args.micro_batch, args.seq_len, vocab, gens[name])
            dt, loss = _timed_step(steps[name], batch)
            losses[name].append(loss)
            if measure:
                samples[name].append(dt)

    for name in sides:
        run_side(name, args.warmup, measure=False)
    for r in range(args.rounds):
        # Rotate, and reverse every other round, so no side always follows the same one.
        rot = sides[r % len(sides) :] + sides[: r % len(sides)]
        order = rot if r % 2 == 0 else tuple(reversed(rot))
        for name in order:
            run_side(name, args.steps_per_round, measure=True)

    # Sanity: the same training on both sides should leave (nearly) the same weights.
    param_diff = None
    if len(sides) >= 2:
        a = models[sides[0]]
        param_diff = max(
            (pa.detach() - pb.detach()).abs().max().item()
            for other in sides[1:]
            for pa, pb in zip(a.parameters(), models[other].parameters(), strict=True)
        )

    if rank == 0:
        _report(args, sides, models[sides[0]], samples, losses, param_diff)


def _report(
    args: argparse.Namespace,
    sides: tuple[str, ...],
    model: GPT,
    samples: dict[str, list[float]],
    losses: dict[str, list[float]],
    param_diff: float | None,
) -> None:
    medians = {name: statistics.median(s) for name, s in samples.items()}
    both = "replicate" in sides and "ddp" in sides
    ratio = medians["replicate"] / medians["ddp"] if both else None
    ratios = {
        f"{n}/ddp": medians[n] / medians["ddp"] for n in sides if n != "ddp" and "ddp" in sides
    }
    # Sample i of each side ran in the same round, so the per-round ratio cancels load that
    # other processes put on the machine for a few seconds; its median is a robustness check.
    paired = None
    if both:
        paired = statistics.median(
            a / b for a, b in zip(samples["replicate"], samples["ddp"], strict=True)
        )
    n_params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {
        "benchmark": "replicate_vs_ddp",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sides": list(sides),
        "medians_s": medians,
        "ratio": ratio,
        "ratios": ratios,
        "paired_ratio_median": paired,
        "samples_s": samples,
        "summary_s": {
            name: {"min": min(s), "max": max(s), "mean": statistics.fmean(s)}
            for name, s in samples.items()
        },
        "losses": losses,
        "max_abs_param_diff": param_diff,
        "config": {
            "model": {
                "name": "reference_gpt",
                "vocab_size": model.vocab_size,
                "d_model": model.d_model,
                "n_layers": model.n_layers,
                "n_heads": model.n_heads,
                "seq_len": model.seq_len,
                "parameters": n_params,
            },
            "optimizer": {"type": "AdamW", "lr": args.lr},
            "micro_batch": args.micro_batch,
            "seq_len": args.seq_len,
            "world_size": args.world_size,
            "threads_per_rank": args.threads,
            "bucket_mb": args.bucket_mb,
            "warmup_steps_per_side": args.warmup,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "measured_steps_per_side": args.rounds * args.steps_per_round,
            "order": "ABBA: side order flips every round",
            "timing": "perf_counter per step per rank, all_reduce MAX over ranks",
            "backend": "gloo",
            "seed": args.seed,
        },
        "versions": versions(),
        "machine": machine(),
    }
    # A one-sided run must not overwrite the comparison, so it gets its own default file.
    default = DEFAULT_OUT.with_suffix(f".{sides[0]}-only.json") if len(sides) == 1 else DEFAULT_OUT
    out = args.out or default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    n = args.rounds * args.steps_per_round
    print(
        f"reference GPT {n_params:,} params, micro-batch {args.micro_batch} x {args.seq_len}, "
        f"{args.world_size} ranks x {args.threads} thread(s), bucket {args.bucket_mb:g} MB"
    )
    for name in sides:
        s = samples[name]
        print(
            f"{name:<20} median {medians[name]:.4f} s  min {min(s):.4f}  max {max(s):.4f}  "
            f"({n} steps, final loss {losses[name][-1]:.4f})"
        )
    if ratio is not None:
        print(f"max |param difference| between sides after training = {param_diff:.3g}")
        for key, value in ratios.items():
            print(f"ratio {key} = {value:.3f}")
        print(f"median of per-round ratios = {paired:.3f}")
        print(f"ratio (replicate / DDP) = {ratio:.3f}")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    """Spawn the ranks, measure, and let rank 0 write the report."""
    args = _parse_args(argv)
    sides = (args.only,) if args.only else SIDES
    if "replicate" in sides:
        import longboat

        if not hasattr(longboat, "initialize"):
            sys.exit("longboat.initialize is not available yet; run with --only ddp")
    port = free_port()
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(args, port, sides), nprocs=args.world_size, join=True)
    print(f"total wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
