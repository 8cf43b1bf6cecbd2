"""Step time of longboat's pipeline against ``torch.distributed.pipelining`` at the same split.

Both sides train the reference GPT (:func:`longboat.models.reference_gpt`, 21,064,704
parameters, untied head, sequence 128, AdamW) over 2 ranks, one pipeline stage per rank (two
with ``interleaved``), on 16 samples per step in ``--micro-batches`` micro-batches, with the
same layers on the same stages: the model's own ``pipeline_layers()`` (embeddings, 4 blocks,
final norm with the head) cut at ``--split`` (``--split-interleaved`` for 4 stages). The
schedules paired:

- ``gpipe``: longboat's ``gpipe`` against torch's ``ScheduleGPipe``;
- ``1f1b``: ``1f1b`` against ``Schedule1F1B``;
- ``interleaved``: ``interleaved`` (2 virtual stages per rank) against
  ``ScheduleInterleaved1F1B``;
- ``interleaved-zb``: ``interleaved-zb`` (2 virtual stages per rank, each backward split into
  its input and weight passes) against ``ScheduleInterleavedZeroBubble``.

Each side runs in a fresh pair of processes (``--warmup`` steps, then ``--steps`` measured), the
two sides of a pair alternating ABBA over ``--repeats``. One step is the schedule's forwards and
backwards, the optimizer step and zero_grad; each rank times its own step and the ranks take
the MAX, outside the timed region. Both sides start from the same weights and see the same
batches, so step k's loss must agree (the largest difference is recorded).

Usage::

    python benchmarks/pipeline_vs_torch.py     # adds "vs_torch" to benchmarks/results/pipeline.json

Measure with nothing else running on the machine.
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
from common import fresh_job, join_loopback, machine, versions
from torch import nn

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline.json"
GLOBAL_BATCH = 16
LR = 3e-4
#: longboat schedule -> torch's schedule of the same order
PAIRS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
}
#: the schedules that run 2 stages per rank (``--split-interleaved``)
INTERLEAVED = {s for k in ("interleaved", "interleaved-zb") for s in (k, PAIRS[k])}


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(PAIRS))
    ap.add_argument("--split", default="0,3,6", help="layer boundaries of the 2 stages")
    ap.add_argument("--split-interleaved", default="0,2,3,4,6", help="of the 4 stages")
    ap.add_argument("--steps", type=int, default=6, help="measured steps per job")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="jobs per side (ABBA)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if GLOBAL_BATCH % args.micro_batches:
        ap.error(f"--micro-batches must divide {GLOBAL_BATCH}")
    if unknown := [s for s in args.schedules.split(",") if s and s not in PAIRS]:
        ap.error(f"--schedules {','.join(unknown)}: choose among {','.join(PAIRS)}")
    return args


def _bounds(text: str) -> list[int]:
    return [int(b) for b in text.split(",")]


class _Chunk(nn.Module):
    """Consecutive layers of ``pipeline_layers()`` as one module, for torch's PipelineStage."""

    def __init__(self, model: nn.Module, layers: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(
            {p.replace(".", "_"): model.get_submodule(p) for paths, *_ in layers for p in paths}
        )
        self.fns = [layer[1] for layer in layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fn in self.fns:
            x = fn(x)
        return x


def _torch_side(model: Any, schedule: str, bounds: list[int], m: int) -> Callable:
    from torch.distributed import pipelining

    from longboat.models import gpt_loss

    rank, world = dist.get_rank(), dist.get_world_size()
    layers = model.pipeline_layers()
    n_stages = len(bounds) - 1
    mine = [s for s in range(n_stages) if s % world == rank]
    stages = [
        pipelining.PipelineStage(
            _Chunk(model, layers[bounds[s] : bounds[s + 1]]), s, n_stages, torch.device("cpu")
        )
        for s in mine
    ]
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    cls = getattr(pipelining, schedule)
    sched = cls(stages if n_stages > world else stages[0], n_microbatches=m, loss_fn=gpt_loss)
    first, last = 0 in mine, n_stages - 1 in mine

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        opt.step()
        opt.zero_grad()
        return float(torch.stack(losses).detach().mean()) if last else None

    return step


def _longboat_side(model: Any, schedule: str, bounds: list[int], m: int) -> Callable:
    import longboat
    from longboat.models import gpt_loss

    pipeline: dict[str, Any] = {"schedule": schedule, "partition": bounds}
    if schedule in INTERLEAVED:
        pipeline["virtual_stages"] = 2
    config = {
        "mesh": {"pp": 2},
        "pipeline": pipeline,
        "batch": {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": m},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "log": {"progress": False, "level": "WARNING"},
    }
    engine = longboat.initialize(model, None, config)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        return float(engine.train_step((x, y), lambda out, mb: gpt_loss(out, mb[1])))

    return step


def _job(rank: int, side: str, args: argparse.Namespace, port: int, out: str) -> None:
    join_loopback(rank, 2, port, args.threads)
    try:
        from longboat.models import reference_gpt, synthetic_tokens

        torch.manual_seed(0)
        model = reference_gpt()
        library, schedule = side.split(":")
        bounds = _bounds(args.split_interleaved if schedule in INTERLEAVED else args.split)
        make = _longboat_side if library == "longboat" else _torch_side
        step = make(model, schedule, bounds, args.micro_batches)
        g = torch.Generator().manual_seed(1000)  # the same batches on both ranks and sides
        times, losses = [], []
        for i in range(args.warmup + args.steps):
            x, y = synthetic_tokens(GLOBAL_BATCH, model.seq_len, model.vocab_size, g)
            t0 = time.perf_counter()
            loss = step(x, y)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            losses.append(loss)
            if i >= args.warmup:
                times.append(t.item())
        if rank == 1:  # the last stage: it has the losses on both sides
            Path(out).write_text(json.dumps({"step_s": times, "losses": losses}))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    groups = [(f"longboat:{s}", f"torch:{PAIRS[s]}") for s in schedules]
    jobs: dict[str, list[dict[str, Any]]] = {side: [] for g in groups for side in g}
    for r in range(args.repeats):
        for group in groups:
            for side in group if r % 2 == 0 else tuple(reversed(group)):
                jobs[side].append(fresh_job(_job, 2, side, args))
                med = statistics.median(jobs[side][-1]["step_s"])
                print(f"repeat {r} {side}: median step {med:.3f} s", flush=True)
    per_job = {s: [statistics.median(j["step_s"]) for j in js] for s, js in jobs.items()}
    medians = {s: statistics.median(v) for s, v in per_job.items()}
    pairs: dict[str, Any] = {}
    for ours, theirs in groups:
        paired = [a / b for a, b in zip(per_job[ours], per_job[theirs], strict=True)]
        diff = max(
            abs(a - b)
            for ja, jb in zip(jobs[ours], jobs[theirs], strict=True)
            for a, b in zip(ja["losses"], jb["losses"], strict=True)
        )
        pairs[ours.split(":")[1]] = {
            "longboat_median_step_s": medians[ours],
            "torch_schedule": theirs.split(":")[1],
            "torch_median_step_s": medians[theirs],
            "ratio_longboat_over_torch": medians[ours] / medians[theirs],
            "paired_ratio_median": statistics.median(paired),
            "max_abs_loss_diff": diff,
        }
    section = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "what": "longboat's pipeline vs torch.distributed.pipelining, reference GPT, 2 ranks, "
        "same split and micro-batches, fresh process pairs alternating ABBA",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        | {"global_batch": GLOBAL_BATCH, "lr": LR},
        "versions": versions(),
        "machine": machine(),
        "median_step_s": medians,
        "per_job_median_step_s": per_job,
        "torch_ratio": pairs,
    }
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data["vs_torch"] = section
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    for name, p in pairs.items():
        print(
            f"{name}: longboat {p['longboat_median_step_s']:.3f} s, torch "
            f"{p['torch_schedule']} {p['torch_median_step_s']:.3f} s, ratio "
            f"{p['ratio_longboat_over_torch']:.3f} (paired {p['paired_ratio_median']:.3f}), "
            f"max |loss diff| {p['max_abs_loss_diff']:.2e}"
        )
    print(f"wrote {args.out} (key vs_torch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
