"""Gradient compression on the reference GPT: loss after a fixed number of steps and bytes on the
wire per step, for exact fp32 all-reduce, bf16 communication, PowerSGD rank 4, 1-bit gradients
(with AdamW), 1-bit Adam (``OneBitAdam``, which compresses its momentum) and 1-bit LAMB
(``OneBitLamb``, against LAMB with DeepSpeed's rule never frozen), all under ``replicate`` on the
same ranks, seed and batches.

Each method trains a fresh reference GPT (:func:`longboat.models.reference_gpt`, AdamW or
OneBitAdam at lr 3e-4; the two LAMB runs at lr 1e-2, since LAMB's step is ``lr`` times the
weight's norm, not per element; next-token data that can be learned: sequences following one fixed
random permutation of the vocabulary, :func:`chain_tokens`) for ``--steps`` steps. Recorded
per method: the mean loss over the last ``--tail`` steps (over every rank), its gap to the
exact run's, and from the comm log of the data-parallel doorway the wire bytes per step of
the gradient collectives, after the warm-up (``--warmup`` exact steps, which every compressed
method takes first), with the exact all-reduce bytes the compressed ones replaced ([Note: bytes
saved] in ``longboat/comm/commlog.py``). Not a timing benchmark: the step times are recorded
but this machine's noise is larger than what compression changes on loopback.

Usage::

    python benchmarks/compression.py               # 100 steps, writes results JSON
    python benchmarks/compression.py --steps 2     # smoke run (warm-up 1)

Writes ``benchmarks/results/compression.json`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions
from torch.utils.data import TensorDataset

import longboat
from longboat.models import gpt_loss, reference_gpt

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compression.json"
GRADIENT_OPS = ("all_reduce", "all_to_all", "all_gather")


def methods(warmup: int, steps: int) -> dict[str, dict[str, Any]]:
    """Each side's config additions (the optimizer's type under ``optimizer``; ``baseline``:
    the method a gap is also measured against)."""
    return {
        "exact": {},
        "bf16": {"precision": {"communication_data_type": "bf16"}},
        "powersgd_rank4": {
            "compression": {"method": "powersgd", "rank": 4, "warmup_steps": warmup}
        },
        "onebit": {"compression": {"method": "onebit", "warmup_steps": warmup}},
        # 1-bit Adam: exact Adam for freeze_step steps, then each rank's momentum in 1 bit
        # (docs/compression.md); no [compression] section, which it refuses. DeepSpeed's
        # defaults otherwise (eps 1e-8).
        "onebitadam": {
            "optimizer_type": "OneBitAdam",
            "optimizer_extra": {"freeze_step": warmup},
        },
        # LAMB with DeepSpeed's 1-bit LAMB rule, never frozen: the exact run 1-bit LAMB is
        # compared with (LAMB learns at its own rate: AdamW's exact run is no baseline for it)
        "lamb": {
            "optimizer_type": "OneBitLamb",
            "optimizer_extra": {"freeze_step": steps + 1, "lr": 1e-2},
        },
        "onebitlamb": {
            "optimizer_type": "OneBitLamb",
            "optimizer_extra": {"freeze_step": warmup, "lr": 1e-2},
            "baseline": "lamb",
        },
    }


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per method")
    p.add_argument("--warmup", type=int, default=None, help="exact steps first (default steps/10)")
    p.add_argument("--tail", type=int, default=None, help="steps averaged for the final loss")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--only", default=None, help="comma-separated methods (default: all)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def _gradient_wire(log: Any) -> tuple[int, int]:
    """(wire bytes of gradient collectives sent, of exact reductions replaced) so far."""
    sent = sum(
        r["wire_bytes"] for r in log.summary() if not r["replaced"] and r["op"] in GRADIENT_OPS
    )
    return sent, log.saved()["exact_wire_bytes"]


def chain_tokens(
    n: int, seq_len: int, vocab: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` next-token sequences that can be learned: each starts at a random token and follows
    one fixed random permutation of the vocabulary (token t is followed by ``perm[t]``). Random
    tokens (``synthetic_tokens``) teach nothing: every method's loss stays at ln(vocab), so a
    loss gap between methods would say nothing about compression."""
    perm = torch.randperm(vocab, generator=generator)
    seq = torch.empty(n, seq_len + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, vocab, (n,), generator=generator)
    for t in range(seq_len):
        seq[:, t + 1] = perm[seq[:, t]]
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _train(args: argparse.Namespace, name: str, extra: dict[str, Any]) -> dict[str, Any]:
    extra = dict(extra)
    opt_type = extra.pop("optimizer_type", "AdamW")
    opt_params = {"lr": 3e-4, "weight_decay": 0.1, **extra.pop("optimizer_extra", {})}
    extra.pop("baseline", None)
    world = dist.get_world_size()
    cfg = {
        "strategy": "replicate",
        "seed": 0,
        "log": {"progress": False, "level": "WARNING"},
        "monitor": {"console": False},
        "comm": {"log": True},
        "batch": {"micro_batch_size": args.micro_batch, "gradient_accumulation_steps": 1},
        "optimizer": {"type": opt_type, "params": opt_params},
        **extra,
    }
    longboat.seed_everything(0)
    model = reference_gpt()
    engine = longboat.initialize(model, config=cfg)
    n = engine.batch.train_batch_size * args.steps
    x, y = chain_tokens(n, model.seq_len, model.vocab_size, torch.Generator().manual_seed(0))
    log = engine.strategy.comm.commlog
    losses, times = [], []
    start = (0, 0)
    t0 = time.perf_counter()
    for xb, yb in engine.loader(TensorDataset(x, y)):
        loss = gpt_loss(engine(xb), yb)
        engine.backward(loss)
        engine.step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
        mean = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if engine.global_step == args.warmup:
            start = _gradient_wire(log)
        if engine.global_step == args.steps:
            break
    sent, replaced = _gradient_wire(log)
    measured = args.steps - args.warmup
    engine.close()
    return {
        "losses": losses,
        "final_loss": sum(losses[-args.tail :]) / args.tail,
        "wire_bytes_per_step_after_warmup": (sent - start[0]) / measured,
        "replaced_wire_bytes_per_step": (replaced - start[1]) / measured,
        "median_step_s": sorted(times)[len(times) // 2],
        "optimizer": opt_type,
        "config": {k: v for k, v in cfg.items() if k in ("compression", "precision")},
    }


def _worker(rank: int, args: argparse.Namespace, port: int, chosen: list[str]) -> None:
    join_loopback(rank, args.world_size, port, args.threads)
    sides = methods(args.warmup, args.steps)
    results = {name: _train(args, name, sides[name]) for name in chosen}
    if rank == 0:
        exact = results.get("exact")
        for name, res in results.items():
            baseline = results.get(sides[name].get("baseline", ""))
            if baseline is not None:
                res["baseline"] = sides[name]["baseline"]
                res["loss_gap_to_baseline"] = res["final_loss"] - baseline["final_loss"]
            if exact is not None:
                res["loss_gap_to_exact"] = res["final_loss"] - exact["final_loss"]
                if res["wire_bytes_per_step_after_warmup"]:
                    res["bytes_ratio_to_exact"] = (
                        exact["wire_bytes_per_step_after_warmup"]
                        / res["wire_bytes_per_step_after_warmup"]
                    )
        report = {
            "benchmark": "compression",
            "model": "reference_gpt (21,064,704 parameters)",
            "strategy": "replicate",
            "world_size": args.world_size,
            "steps": args.steps,
            "warmup_steps": args.warmup,
            "tail": args.tail,
            "micro_batch": args.micro_batch,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": versions(),
            "machine": machine(),
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        for name, res in results.items():
            print(
                f"{name:16s} final_loss={res['final_loss']:.4f} "
                f"gap={res.get('loss_gap_to_exact', 0.0):+.4f} "
                f"wire/step={res['wire_bytes_per_step_after_warmup']:,.0f} "
                f"ratio={res.get('bytes_ratio_to_exact', float('nan')):.1f}"
                f" vs_baseline={res.get('loss_gap_to_baseline', float('nan')):+.4f}"
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.warmup is None:
        args.warmup = max(args.steps // 10, 1)
    if args.tail is None:
        args.tail = max(min(20, args.steps - args.warmup), 1)
    if not 0 < args.warmup < args.steps:
        sys.exit(f"--warmup {args.warmup} must lie between 0 and --steps {args.steps}")
    known = methods(args.warmup, args.steps)
    chosen = args.only.split(",") if args.only else list(known)
    unknown = set(chosen) - set(known)
    if unknown:
        sys.exit(f"--only: unknown methods {sorted(unknown)}; choose from {list(known)}")
    mp.spawn(_worker, args=(args, free_port(), chosen), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
