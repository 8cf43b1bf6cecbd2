"""``longboat plan``: per-rank memory and communication of each strategy, and which fits.

Every strategy is simulated by :func:`longboat.plan.simulate.simulate` (the engine on meta
tensors), so the model-state bytes are those ``engine.memory_report()`` measures on a real run,
byte for byte, and nothing is allocated: a billion-parameter model is planned on a laptop.

[Note: recommendation] Among the strategies whose predicted peak fits the budget (all of them
without a budget), the one that communicates least per step wins, in the order replicate,
zero-1, zero-2, zero-3: replicate all-reduces gradients once; zero-1 and zero-2 send the same
bytes per step (reduce-scatter plus all-gather of parameters), but with gradient accumulation
zero-2 reduce-scatters after every micro-batch and zero-1 only at the boundary; zero-3 gathers
parameters again in forward and backward. Then ZeRO with its optimizer state on disk
(``zero-N+offload``; ``zero-3+offload`` keeps its parameter and gradient shards there too): it
moves the state through the disk at least twice per step, so it is planned only
when a budget is given and nothing else fits (``longboat plan`` without ``--strategies``), or
when asked for. A parameter server comes last,
as it needs server ranks beside the workers and every worker's push and pull pass through them.
At one rank the only strategy is single.

[Note: unplanned rows] A strategy the planner cannot simulate for this model (pipeline stages of
a model that does not list its layers, a tensor-parallel plan that does not apply, an operator
fake tensors cannot run) is a row with a one-line ``error`` and no figures, never the end of the
whole plan: the other rows are still planned and shown. What no row could change (a mesh that
does not fit the world size, a schedule its micro-batches cannot fill, an unknown strategy)
is checked first, once, and refused as a usage error (:class:`PlanInputError`).

[Note: planning roles] A strategy whose ranks are not alike (a parameter server's workers and
servers) is planned by its own module, a row per role (:data:`ROLES`); it is planned when
``--strategies`` names it or the config's strategy is it, not by default.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from longboat.config.sections import Config
from longboat.mesh import Mesh
from longboat.observe.memory import CATEGORIES
from longboat.plan.device import DEVICES, workspaces
from longboat.plan.parameter_server import parameter_server_roles
from longboat.plan.simulate import Simulated, simulate
from longboat.plan.stages import Shapes, each_stage
from longboat.plan.target import PlanInputError, Target, whole_model_params

STRATEGIES = ("single", "replicate", "zero-1", "zero-2", "zero-3")
#: ZeRO with its optimizer state (and, stage 3, its parameters and gradients) on disk: planned
#: where nothing else fits a budget, or asked for.
OFFLOADED = ("zero-1+offload", "zero-2+offload", "zero-3+offload")
OFFLOAD_PATH = "<planned>"  # the planner's run on fake tensors writes no file
#: ZeRO-Offload beside a GPU: the optimizer state and fp32 masters (and, stage 3, the parameter
#: and gradient shards) in host memory, the optimizer stepping on the CPU; planned with
#: ``--device cuda`` ([Note: planning host offload] in ``placement.py``).
HOST_OFFLOADED = ("zero-1+cpu", "zero-2+cpu", "zero-3+cpu")
PREFERENCE = (  # see [Note: recommendation]
    "replicate",
    "zero-1",
    "zero-2",
    "zero-3",
    *HOST_OFFLOADED,
    *OFFLOADED,
    "parameter_server",
)
#: Planned by their own module, a row per role ([Note: planning roles]).
ROLES: dict[str, Callable[..., list[tuple[str, Simulated]]]] = {
    "parameter_server": parameter_server_roles,
}
KNOWN = (*STRATEGIES, *HOST_OFFLOADED, *OFFLOADED, *ROLES)

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def strategy_config(base: Config, strategy: str, micro_batch: int) -> Config:
    """``base`` (its bucket sizes, units, precision, mesh and pipeline...) with ``strategy``
    and the micro-batch. Each step runs the config's ``batch.gradient_accumulation_steps``
    micro-batches (1 when unset; with pipeline stages, the schedule's micro-batches);
    ``single`` is one process with the whole model, for comparison, at the same micro-batch
    and accumulation."""
    if strategy not in KNOWN:
        raise PlanInputError(
            f"--strategies: unknown strategy {strategy!r}; choose from {', '.join(KNOWN)}"
        )
    batch = base.batch.model_copy(
        update={
            "micro_batch_size": micro_batch,
            "train_batch_size": None,
            "gradient_accumulation_steps": base.batch.gradient_accumulation_steps or 1,
        }
    )
    update: dict[str, Any] = {
        "strategy": strategy.split("-")[0],
        "batch": batch,
        "log": base.log.model_copy(update={"progress": False}),
    }
    if strategy == "single":
        update["mesh"] = type(base.mesh)()
        update["pipeline"] = type(base.pipeline)()
    if strategy.startswith("zero-"):
        stage, offload = strategy.removeprefix("zero-").partition("+")[::2]
        zero: dict[str, Any] = {"stage": int(stage)}
        if int(stage) != 3:  # parameters are sharded, and so offloaded, by stage 3 only
            zero["offload_param"] = type(base.zero.offload_param)()
        if offload:  # [Note: recommendation]: where nothing else fits
            # "+cpu": ZeRO-Offload beside a GPU; "+offload": on disk
            where = (
                {"device": "cpu"} if offload == "cpu" else {"device": "disk", "path": OFFLOAD_PATH}
            )
            zero["offload_optimizer"] = type(base.zero.offload_optimizer)(**where)
            if int(stage) == 3:  # and stage 3's parameters and gradients too
                zero["offload_param"] = type(base.zero.offload_param)(**where)
        update["zero"] = base.zero.model_copy(update=zero)
    return base.model_copy(update=update)


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy's prediction for one rank."""

    strategy: str
    world_size: int
    model_state: dict[str, int]
    activations: int
    transient: int
    peak: int
    comm_bytes: dict[str, int]
    fits: bool | None  # None without a budget
    stages: tuple[int, ...] = ()  # with pipeline stages: those of this rank (a row per rank)
    in_flight: int = 0  # with pipeline stages: most micro-batches' activations held at once
    #: with tensor parallelism: bytes each divided layer sends per step, by module name
    tp_layers: dict[str, int] = field(default_factory=dict)
    role: str = ""  # a strategy whose ranks differ: which ([Note: planning roles])
    disk: int = 0  # model state on disk (offload)
    disk_moved: int = 0  # ... and read and written per step
    host: int = 0  # beside a GPU: the most host memory ZeRO-Offload held (state, masters...)
    #: the math libraries' workspaces on the plan's device, in ``transient`` and ``peak``
    #: ([Note: library workspaces] in ``device.py``)
    workspaces: int = 0
    error: str = ""  # why this strategy could not be planned ([Note: unplanned rows])

    @property
    def comm_total(self) -> int:
        return sum(self.comm_bytes.values())


@dataclass(frozen=True)
class Plan:
    """The whole answer of ``longboat plan``."""

    model: str
    trainable_params: int
    world_size: int
    micro_batch: int
    precision: str
    optimizer: str
    budget: int | None
    strategies: list[StrategyPlan]  # with pipeline stages, one row per strategy and pp rank
    recommended: str | None
    reason: str
    pipeline: dict[str, Any] | None = None  # pp, schedule, micro-batches, idle fraction
    accumulation: int = 1  # micro-batches per optimizer step (with pp: the schedule's)
    device: str = "cpu"  # what the peaks are for: "cuda" adds the libraries' workspaces
    workspaces: str = ""  # how those were sized

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for s, plan in zip(out["strategies"], self.strategies, strict=True):
            s["comm_total"] = plan.comm_total
        return out


def _mesh(cfg: Config, n: int) -> Mesh:
    from longboat.config.errors import ConfigError
    from longboat.engine import resolve_mesh

    try:
        return resolve_mesh(cfg, n)
    except ConfigError as e:
        raise PlanInputError(f"--world-size {n}: {e}") from None


def _check_usage(base: Config, strategies: Sequence[str], world_size: int) -> None:
    """Refuse what no strategy's row could plan: unknown names, a mesh that does not fit the
    world size, a pipeline schedule its micro-batches cannot fill ([Note: unplanned rows])."""
    for name in strategies:
        cfg = strategy_config(base, name, 1)
        if name not in ROLES:  # a role's own module checks its mesh (servers stand aside)
            _mesh(cfg, 1 if name == "single" else world_size)
    if base.mesh.pp > 1:
        from longboat.pipeline import ScheduleError, build_pipeline_schedule

        m = base.batch.gradient_accumulation_steps or 1
        kind, v = base.pipeline.schedule, base.pipeline.virtual_stages
        try:
            build_pipeline_schedule(kind, base.mesh.pp, m, v)
        except ScheduleError as e:
            raise PlanInputError(
                f"pipeline schedule {kind!r} with {m} micro-batches per step (--micro-batches, "
                f"batch.gradient_accumulation_steps): {e}"
            ) from None


def one_line(e: BaseException) -> str:
    """An exception as one line: its message's first line, after its type unless longboat
    raised it (its messages already say what is wrong and what to change)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    raiser = str(tb.tb_frame.f_globals.get("__name__", "")) if tb is not None else ""
    if text and (type(e).__module__.startswith("longboat") or raiser.startswith("longboat")):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextlib.contextmanager
def _quiet_fake_tensors() -> Iterator[None]:
    """Fake tensors log a traceback of their own for an operator whose meta kernel fails before
    re-raising it; the planner reports that failure in its row ([Note: unplanned rows])."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _pipeline_facts(base: Config, world_size: int) -> dict[str, Any] | None:
    if base.mesh.pp == 1:
        return None
    from longboat.pipeline import bubble_theory

    m = base.batch.gradient_accumulation_steps or 1
    pp, v = base.mesh.pp, base.pipeline.virtual_stages
    return {
        "pp": pp,
        "dp": _mesh(base, world_size).dp,
        "schedule": base.pipeline.schedule,
        "virtual_stages": v,
        "micro_batches": m,
        "idle_fraction": bubble_theory(pp, m, v, kind=base.pipeline.schedule),
    }


def _recommend(
    plans: Sequence[StrategyPlan], world_size: int, budget: int | None
) -> tuple[str | None, str]:
    # A strategy fits when every one of its rows (every pipeline rank) does.
    over = {p.strategy for p in plans if p.fits is False or p.error}
    fitting = {p.strategy for p in plans} - over
    if world_size == 1 and "single" in fitting:
        return "single", "one rank: nothing to share"
    for name in PREFERENCE:
        if name in fitting:
            why = (
                "the fastest-communicating strategy that fits "
                f"(preference: {' > '.join(PREFERENCE)})"
            )
            if budget is None:
                why = f"no --budget given; {why}"
            return name, why
    unplanned = list(dict.fromkeys(p.strategy for p in plans if p.error))
    planned = [n for n in dict.fromkeys(p.strategy for p in plans) if n not in unplanned]
    if budget is None or not planned:
        if unplanned:
            return None, f"{', '.join(unplanned)} could not be planned (see why above)"
        return None, "no candidate strategy"
    why = f"none of {', '.join(planned)} fits in {budget:,} bytes per rank"
    if unplanned:
        why += f"; {', '.join(unplanned)} could not be planned"
    return None, why


def _plan_one(
    target: Target,
    base: Config,
    name: str,
    world_size: int,
    micro_batch: int,
    make: Callable[[Any], torch.optim.Optimizer],
    budget: int | None,
    rank: int,
    extra: int = 0,
    accelerator: bool = False,
) -> tuple[list[StrategyPlan], int]:
    """Strategy ``name``'s rows (one, or one per pipeline rank or role) and the trainable
    parameters its simulation counted."""
    cfg = strategy_config(base, name, micro_batch)
    # single is one process on its own, whatever the world size (for comparison).
    n = 1 if name == "single" else world_size

    def one(r: int, shapes: Shapes | None = None) -> Simulated:
        return simulate(
            target, cfg, n, micro_batch, make, rank=r, shapes=shapes, accelerator=accelerator
        )

    roles: list[str] = []
    trainable = 0
    try:
        if name in ROLES:
            rows = ROLES[name](target, cfg, n, micro_batch, make)
            roles, sims = [r for r, _ in rows], [s for _, s in rows]
            trainable = sims[0].trainable_params
        elif (mesh := _mesh(cfg, n)).pp > 1:
            sims = each_stage(mesh, one)  # a row per pipeline rank: they hold different layers
        else:
            sims = [one(min(rank, n - 1))]
            trainable = sims[0].trainable_params
    except PlanInputError:
        raise  # the command line's mistake, whichever strategy meets it
    except Exception as e:  # this strategy's row says why ([Note: unplanned rows])
        why = one_line(e)
        if type(e).__module__ == "torch._subclasses.fake_tensor":
            why += " (the planner runs the model on fake tensors: shapes without values)"
        empty = dict.fromkeys(CATEGORIES, 0)
        return [StrategyPlan(name, n, empty, 0, 0, 0, {}, None, error=why)], 0
    plans = [
        StrategyPlan(
            strategy=name,
            role=role,
            world_size=n,
            model_state=sim.model_state,
            activations=sim.activations,
            transient=sim.transient + extra,
            peak=sim.peak + extra,
            comm_bytes=sim.comm_bytes,
            fits=None if budget is None else sim.peak + extra <= budget,
            stages=sim.stages,
            in_flight=sim.in_flight,
            tp_layers=sim.tp_layers,
            disk=sim.disk,
            disk_moved=sim.disk_moved,
            host=sim.host,
            workspaces=extra,
        )
        for sim, role in zip(sims, roles or [""] * len(sims), strict=True)
    ]
    return plans, trainable


def make_plan(
    target: Target,
    base: Config,
    world_size: int,
    micro_batch: int,
    optimizer: str = "adamw",
    strategies: Sequence[str] = STRATEGIES,
    budget: int | None = None,
    rank: int = 0,
    try_offload: bool = True,
    device: str = "cpu",
) -> Plan:
    """Simulate each of ``strategies`` at ``world_size`` ranks and recommend one; with
    ``try_offload``, when a budget is given and none fits, ZeRO with its optimizer state on
    disk too ([Note: recommendation]).

    The figures are those of ``rank`` (default 0). Ranks differ by a few bytes under ZeRO: the
    padding of each unit sits on the last rank, and per-parameter optimizer scalars (Adam's
    ``step``) exist for each parameter a rank's shard overlaps.

    ``device`` "cuda" adds to each peak the workspaces cuBLAS keeps on a GPU, which the trace
    on fake CPU tensors cannot see ([Note: library workspaces] in ``device.py``)."""
    if device not in DEVICES:
        raise PlanInputError(f"--device {device!r} is unknown; choose from {', '.join(DEVICES)}")
    beside = [n for n in strategies if n in HOST_OFFLOADED]
    if beside and device != "cuda":
        raise PlanInputError(
            f"--strategies {beside[0]} is ZeRO-Offload beside a GPU: add --device cuda (on a "
            "CPU rank the optimizer state is in host memory already: plan zero-N)"
        )
    if world_size < 1:
        raise PlanInputError(f"--world-size {world_size} is invalid: use 1 or more")
    if micro_batch < 1:
        raise PlanInputError(f"--micro-batch {micro_batch} is invalid: use 1 or more")
    if optimizer not in OPTIMIZERS:
        raise PlanInputError(
            f"--optimizer {optimizer!r} is unknown; choose from {', '.join(OPTIMIZERS)}"
        )
    make = OPTIMIZERS[optimizer]
    _check_usage(base, strategies, world_size)
    plans: list[StrategyPlan] = []
    counted: list[int] = []
    extra = workspaces(device)
    at = (world_size, micro_batch, make, budget, rank, extra.bytes, device == "cuda")
    with _quiet_fake_tensors():
        for name in strategies:
            rows, n = _plan_one(target, base, name, *at)
            plans += rows
            counted.append(n)
        planned = {p.strategy for p in plans}
        recommended, reason = _recommend(plans, world_size, budget)
        if (
            try_offload
            and recommended is None
            and budget is not None
            and base.mesh.pp == base.mesh.tp == 1
            and not planned & {*OFFLOADED, *HOST_OFFLOADED}
        ):  # nothing fits: ZeRO with its state in host memory beside a GPU, else on disk
            for group in ((HOST_OFFLOADED,) if device == "cuda" else ()) + (OFFLOADED,):
                for name in group:
                    plans += _plan_one(target, base, name, *at)[0]
                recommended, reason = _recommend(plans, world_size, budget)
                if recommended is not None:
                    break
        # The last strategy's count, as always; the whole model's where stages hold parts or
        # the simulation counted nothing (a row that could not be planned).
        trainable = counted[-1] if counted else 0
        if base.mesh.pp > 1 or not trainable:
            trainable = whole_model_params(target)
    return Plan(
        model=target.name,
        trainable_params=trainable,
        world_size=world_size,
        micro_batch=micro_batch,
        precision=base.precision.dtype,
        optimizer=optimizer,
        budget=budget,
        strategies=plans,
        recommended=recommended,
        reason=reason,
        pipeline=_pipeline_facts(base, world_size),
        accumulation=base.batch.gradient_accumulation_steps or 1,
        device=device,
        workspaces=extra.how,
    )


__all__ = [
    "CATEGORIES",
    "KNOWN",
    "OFFLOADED",
    "OPTIMIZERS",
    "PREFERENCE",
    "STRATEGIES",
    "Plan",
    "StrategyPlan",
    "make_plan",
    "strategy_config",
]
