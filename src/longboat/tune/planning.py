"""The planning half of a search: which layouts a model can take, the planner and work counter
run on each candidate, and the order to plan candidates in when ``--time`` may not cover all.

[Note: capabilities] Pipeline stages and tensor-parallel ranks are searched where the model can
take them, as the engine would find it: the pipeline's :func:`~longboat.pipeline.stages.stageable`
(an ``nn.Sequential``, a ``PipelineModule``, a model with ``pipeline_layers()``, a transformers
family whose layers are built in) and the tensor-parallel plan the config names
(:func:`~longboat.tensor.plans.has_plan`: a built-in plan for the model's class under ``auto``).
The model is built once on the meta device to be asked (nothing is allocated). Degrees the user
names (``--pp``, ``--tp``) are tried whatever the answer: what the engine then refuses is
recorded with its message, as for every other candidate. What is not searched, and why, is a
note in the report.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from longboat.bench.models import ModelSpec
from longboat.plan.target import Target
from longboat.tune.cost import Planned, Work, count_work
from longboat.tune.layout import PLAIN, Layout
from longboat.tune.target import plan_target

if TYPE_CHECKING:
    from longboat.tune.space import Candidate

Planner = Callable[["Candidate"], Planned]
WorkOf = Callable[[int, tuple[str, ...]], Work]
#: Pipeline schedules searched by default: one stage per rank, the backward whole or split.
SCHEDULES = ("1f1b", "zb-h1")


def divisors(n: int) -> list[int]:
    """The degrees above one that divide ``n`` ranks."""
    return [d for d in range(2, n + 1) if n % d == 0]


def layouts(
    build: Callable[[], torch.nn.Module] | None,
    world_size: int,
    pp: Sequence[int] | None = None,
    tp: Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    tp_plan: str | dict[str, Any] = "auto",
) -> tuple[list[Layout], list[str]]:
    """The layouts to search at ``world_size`` ranks, and notes on what is not searched and why
    ([Note: capabilities]). ``pp``/``tp``: the degrees to try (None: every divisor of the world
    size the model can take, and 1); ``build``: the model (None: not known, so only the degrees
    named are tried)."""
    model = None
    if build is not None and (pp is None or tp is None):
        with torch.device("meta"):
            model = build()
    notes: list[str] = []
    why = {
        "pp": "the model does not list its layers (pipeline_layers(), nn.Sequential, "
        "PipelineModule)",
        "tp": f"no tensor-parallel plan names the model under tensor_parallel.plan = {tp_plan!r}",
    }

    def degrees(named: Sequence[int] | None, axis: str, able: Callable[[Any], bool]) -> list[int]:
        if named is not None:
            return sorted({1, *named})
        if world_size == 1:
            return [1]
        if model is None:
            notes.append(f"mesh.{axis}: not searched without the model (name degrees: --{axis})")
            return [1]
        if not able(model):
            notes.append(f"mesh.{axis}: not searched: {why[axis]} ({type(model).__name__})")
            return [1]
        return [1, *divisors(world_size)]

    from longboat.pipeline.stages import stageable
    from longboat.tensor.plans import has_plan

    pps = degrees(pp, "pp", stageable)
    tps = degrees(tp, "tp", lambda m: has_plan(tp_plan, m))
    out: list[Layout] = []
    for p, t in itertools.product(pps, tps):
        named = (p == 1 or pp is not None) and (t == 1 or tp is not None)
        if world_size % (p * t) and not named:
            continue  # a product the world cannot hold, of degrees not all named
        out += [Layout(p, t, s) for s in schedules] if p > 1 else [Layout(1, t)]
    return out or [PLAIN], notes


def planner_for(target: Target, world_size: int) -> Planner:
    """Plans a candidate with ``longboat.plan.simulate``: the engine and the candidate's
    strategy on fake tensors, two optimizer steps of its accumulation; with pipeline stages,
    every stage's first rank ([Note: planning stages]), the figures of the rank with the
    highest peak and the most bytes sent."""
    from longboat.engine import resolve_mesh
    from longboat.plan.planner import OFFLOAD_PATH, OPTIMIZERS
    from longboat.plan.simulate import Simulated, simulate
    from longboat.plan.stages import Shapes, each_stage

    def plan(c: Candidate) -> Planned:
        cfg = c.config
        if cfg.zero.offload_optimizer.device == "disk":  # the fake run writes no file
            zero = cfg.zero.model_copy(
                update={
                    "offload_optimizer": cfg.zero.offload_optimizer.model_copy(
                        update={"path": OFFLOAD_PATH}
                    ),
                    "offload_param": cfg.zero.offload_param.model_copy(
                        update={"path": OFFLOAD_PATH}
                    ),
                }
            )
            cfg = cfg.model_copy(update={"zero": zero})
        cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"progress": False})})

        def one(rank: int, shapes: Shapes | None = None) -> Simulated:
            adamw = OPTIMIZERS["adamw"]
            return simulate(target, cfg, world_size, c.micro_batch, adamw, rank, shapes)

        mesh = resolve_mesh(cfg, world_size)
        sims = each_stage(mesh, one) if mesh.pp > 1 else [one(0)]
        high = max(sims, key=lambda s: s.peak)
        loud = max(sims, key=lambda s: sum(s.comm_bytes.values()))
        return Planned(
            peak=high.peak,
            model_state=high.model_state,
            activations=high.activations,
            comm_bytes=loud.comm_bytes,
            comm_calls=loud.comm_calls,
            disk_moved=max(s.disk_moved for s in sims),
        )

    return plan


def default_planner(spec: ModelSpec, world_size: int) -> Planner:
    """:func:`planner_for` the planner's view of a bench model."""
    return planner_for(plan_target(spec), world_size)


def work_for(target: Target) -> WorkOf:
    """Counts a micro-batch's flops and operators on fake tensors, once per size and recompute."""
    cache: dict[tuple[int, tuple[str, ...]], Work] = {}

    def work(micro: int, recompute: tuple[str, ...]) -> Work:
        key = (micro, recompute)
        if key not in cache:
            cache[key] = count_work(target.build, target.example_input, target.loss, *key)
        return cache[key]

    return work


def default_work(spec: ModelSpec) -> WorkOf:
    """:func:`work_for` the planner's view of a bench model."""
    return work_for(plan_target(spec))


def promising_first(candidates: list[Candidate], buckets_mb: tuple[float, ...]) -> list[Candidate]:
    """``candidates`` in the order to plan them when the time may not cover all: round the
    layouts and strategies, each one's plainest first (no recompute, gradients in fp32, the
    first bucket size given, the largest micro-batch: the usual fastest that fits)."""

    def plainness(c: Candidate) -> tuple[bool, bool, int, int]:
        bucket = buckets_mb.index(c.bucket_mb) if c.bucket_mb in buckets_mb else 0
        return (
            bool(c.recompute),
            c.comm_dtype != "fp32" or c.precision != "fp32",
            bucket,
            -c.micro_batch,
        )

    by_kind: dict[tuple[Layout, str], list[Candidate]] = {}
    for c in sorted(candidates, key=plainness):
        by_kind.setdefault((c.layout, c.strategy), []).append(c)
    rounds = itertools.zip_longest(*by_kind.values())
    return [c for row in rounds for c in row if c is not None]
