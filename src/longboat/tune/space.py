"""The candidates ``longboat tune`` considers: every combination of what the config can vary that
changes speed or memory, each built as a real longboat config.

[Note: search space] Strategy (``replicate``, ZeRO stages 1-3, and ZeRO-3 with its state on disk
when an offload directory is given; ``single`` at one rank), micro-batch size for the fixed
global batch (powers of two up to a rank's share of it, and the share itself; accumulation =
global / (micro x data-parallel ranks)), bucket size (``replicate.bucket_mb`` or
``zero.bucket_mb``; stage 3 has none), activation checkpointing of the model's block classes,
the dtype gradients travel in, and the precision the model computes and keeps its parameters in
(``fp32``; ``bf16``: autocast, fp32 parameters; ``bf16-params``: bf16 parameters with fp32
masters, ``precision.param_dtype``, which the config takes under ZeRO stages 1-3 but not
``replicate`` nor offload, so those combinations are recorded refused). A combination is
kept only when the config accepts it: its mapping goes through :func:`longboat.load_config`, its
batch triple through :func:`~longboat.config.resolve_batch` and its mesh through the engine's
own check, and what any of them refuses is recorded with the message they gave (the planner's
run adds what the strategies refuse at setup). The search never invents a rule of its own about
what is valid.

[Note: layouts] Each combination is also laid out on a mesh (:class:`Layout`): pipeline stages
(``mesh.pp``, with a schedule, ``1f1b`` or ``zb-h1``; the split is the default one, the
micro-batches per step are the accumulation) and tensor-parallel ranks (``mesh.tp``), with the
data-parallel strategies on the ranks they leave. Which degrees are tried is the caller's
(``longboat tune`` asks the model whether it lists its layers and whether a tensor-parallel
plan names it). A layout that leaves one data-parallel rank has nothing to share between ranks:
its only strategy is ``replicate`` (what ``auto`` resolves to), with no bucket or
communication-dtype dimension, as at one rank nothing travels either. A schedule that cannot run
the accumulation's micro-batches is refused by the pipeline's own check, in its words.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from longboat.config.batch import resolve_batch
from longboat.config.errors import ConfigError
from longboat.config.loading import load_config
from longboat.config.sections import Config
from longboat.tune.layout import PLAIN, Layout

#: Strategies searched at two ranks or more; ``single`` is the only one at one rank.
STRATEGIES = ("replicate", "zero-1", "zero-2", "zero-3")
OFFLOADED = "zero-3+offload"  # only with an offload directory: it needs a disk path
DEFAULT_BUCKETS_MB = (25.0, 5.0)  # longboat's default, and a fifth of it
COMM_DTYPES = ("fp32", "bf16", "fp16")
#: ``precision`` values the search can try, and the ``[precision]`` table each one writes
PRECISIONS: dict[str, dict[str, str]] = {
    "fp32": {},
    "bf16": {"dtype": "bf16"},
    "bf16-params": {"dtype": "bf16", "param_dtype": "bf16"},
}
_PRECISION_LABELS = {"fp32": "", "bf16": "bf16-amp", "bf16-params": "bf16-params"}


@dataclass(frozen=True)
class Candidate:
    """One configuration to plan and perhaps measure. ``mapping`` is the longboat config as
    written to a file (the keys that differ from the defaults, and the batch triple in full);
    ``config`` is it validated."""

    strategy: str  # single, replicate, zero-1..3, zero-3+offload
    micro_batch: int
    accumulation: int
    bucket_mb: float | None  # None: the strategy has no gradient buckets (stage 3, single)
    recompute: tuple[str, ...]  # module classes recomputed in backward; () for none
    comm_dtype: str  # the dtype gradients travel in (fp32: their own)
    mapping: dict[str, Any] = field(compare=False, repr=False)
    config: Config = field(compare=False, repr=False)
    precision: str = "fp32"  # a key of PRECISIONS
    layout: Layout = PLAIN

    @property
    def name(self) -> str:
        """Short and unique within a search: ``zero-2 m4x2 b25 rc bf16``, ``pp2 1f1b replicate
        m2x8``."""
        return label(
            self.strategy,
            f"m{self.micro_batch}x{self.accumulation}",
            self.bucket_mb,
            bool(self.recompute),
            self.comm_dtype,
            self.precision,
            self.layout,
        )


def label(
    strategy: str,
    batch: str,
    bucket_mb: float | None,
    rc: bool,
    comm: str,
    precision: str = "fp32",
    layout: Layout = PLAIN,
) -> str:
    """A combination's name: the layout (``pp2 1f1b``, ``tp2``) unless plain, strategy,
    micro-batch (x accumulation), bucket, ``rc`` for recompute, the communication dtype unless
    fp32, and the precision unless fp32 (``bf16-amp``, ``bf16-params``)."""
    parts = [layout.label] if layout.label else []
    parts += [strategy, batch]
    if bucket_mb is not None:
        parts.append(f"b{bucket_mb:g}")
    parts += ["rc"] if rc else []
    parts += [comm] if comm != "fp32" else []
    parts += [_PRECISION_LABELS[precision]] if precision != "fp32" else []
    return " ".join(parts)


@dataclass(frozen=True)
class Invalid:
    """A combination the config (or a strategy at setup) refused, and its own words why."""

    name: str
    mapping: dict[str, Any]
    reason: str


@dataclass
class Space:
    """What :func:`build_space` found: the valid candidates and the refused combinations."""

    candidates: list[Candidate]
    invalid: list[Invalid]


def micro_batches(share: int) -> list[int]:
    """Micro-batch sizes to try for a rank's ``share`` of the global batch: powers of two up to
    it, and the share itself. A size that does not divide the share is still tried, so that
    the config's own check refuses it by name."""
    sizes = {1 << k for k in range(share.bit_length()) if 1 << k <= share}
    return sorted(sizes | {share})


def _mapping(
    strategy: str,
    global_batch: int,
    micro: int,
    bucket_mb: float | None,
    recompute: tuple[str, ...],
    comm_dtype: str,
    offload_dir: str | None,
    precision: str = "fp32",
    layout: Layout = PLAIN,
) -> dict[str, Any]:
    """The longboat config of one combination: only what differs from the defaults, so the
    written file says what was chosen and nothing else."""
    data: dict[str, Any] = {
        "strategy": strategy.split("-")[0],
        "batch": {"train_batch_size": global_batch, "micro_batch_size": micro},
        **layout.sections(),
    }
    if strategy == "replicate" and bucket_mb is not None:
        data["replicate"] = {"bucket_mb": bucket_mb}
    if strategy.startswith("zero-"):
        stage, _, offload = strategy.removeprefix("zero-").partition("+")
        zero: dict[str, Any] = {"stage": int(stage)}
        if bucket_mb is not None:
            zero["bucket_mb"] = bucket_mb
        if offload:
            zero["offload_optimizer"] = {"device": "disk", "path": offload_dir}
            zero["offload_param"] = {"device": "disk", "path": offload_dir}
        data["zero"] = zero
    if recompute:
        data["activation_checkpointing"] = {"classes": list(recompute)}
    table = dict(PRECISIONS[precision])
    if comm_dtype != "fp32":
        table["communication_data_type"] = comm_dtype
    if table:
        data["precision"] = table
    return data


def _validate(data: dict[str, Any], world_size: int) -> int:
    """The accumulation a run at ``world_size`` resolves ``data``'s batch to; raises
    :class:`ConfigError` with the config's own message where it refuses ``data``."""
    from longboat.engine import resolve_mesh

    cfg = load_config(data)
    mesh = resolve_mesh(cfg, world_size)  # the world must lay out on the config's mesh
    batch = resolve_batch(cfg.batch, cfg.data_parallel_size(world_size))
    if mesh.pp > 1:  # the schedule must run the step's micro-batches: the pipeline's own check
        from longboat.pipeline import ScheduleError, build_pipeline_schedule

        p = cfg.pipeline
        m = batch.gradient_accumulation_steps
        try:
            build_pipeline_schedule(p.schedule, mesh.pp, m, p.virtual_stages)
        except ScheduleError as e:
            raise ConfigError(
                f"key 'pipeline.schedule' = {p.schedule!r} with {m} micro-batches "
                f"(batch.gradient_accumulation_steps): {e}"
            ) from None
    return batch.gradient_accumulation_steps


def build_space(
    world_size: int,
    global_batch: int,
    *,
    micro_sizes: Sequence[int] | None = None,
    buckets_mb: Sequence[float] = DEFAULT_BUCKETS_MB,
    recompute_classes: Sequence[str] = (),
    comm_dtypes: Sequence[str] = ("fp32",),
    offload_dir: str | None = None,
    precisions: Sequence[str] = ("fp32",),
    layouts: Sequence[Layout] = (PLAIN,),
) -> Space:
    """Every combination ([Note: search space]) at ``world_size`` ranks and ``global_batch``
    samples per step. ``recompute_classes``: the model's block classes (empty: activation
    checkpointing is not searched); ``offload_dir``: adds ZeRO-3 with its state on disk there;
    ``precisions``: keys of :data:`PRECISIONS`; ``layouts``: the meshes to lay each on
    ([Note: layouts])."""
    recomputes = [(), tuple(recompute_classes)] if recompute_classes else [()]
    space = Space([], [])
    for layout in layouts:
        dp = max(world_size // (layout.pp * layout.tp), 1)
        strategies: tuple[str, ...] = (
            ("single",) if world_size == 1 else ("replicate",) if dp == 1 else STRATEGIES
        )
        if offload_dir is not None and dp > 1:
            strategies = (*strategies, OFFLOADED)
        share = max(global_batch // dp, 1)
        sizes = sorted(set(micro_sizes)) if micro_sizes else micro_batches(share)
        comms = list(comm_dtypes) if dp > 1 else ["fp32"]  # nothing travels at one dp rank
        for strategy in strategies:
            bucketed = dp > 1 and strategy in ("replicate", "zero-1", "zero-2")
            buckets = list(buckets_mb) if bucketed else [None]
            combos = itertools.product(sizes, buckets, recomputes, comms, precisions)
            for micro, bucket, rc, comm, prec in combos:
                at = (layout, strategy, micro, bucket, rc, comm, prec)
                _add(space, world_size, global_batch, offload_dir, *at)
    return space


def _add(
    space: Space,
    world_size: int,
    global_batch: int,
    offload_dir: str | None,
    layout: Layout,
    strategy: str,
    micro: int,
    bucket: float | None,
    rc: tuple[str, ...],
    comm: str,
    prec: str,
) -> None:
    """One combination into ``space``: a candidate, or an invalid one with the refusal."""
    data = _mapping(strategy, global_batch, micro, bucket, rc, comm, offload_dir, prec, layout)
    try:
        accumulation = _validate(data, world_size)
    except ConfigError as e:
        name = label(strategy, f"m{micro}", bucket, bool(rc), comm, prec, layout)
        space.invalid.append(Invalid(name, data, str(e)))
        return
    # The file states the whole triple, so a run at another world size is refused rather than
    # silently given another accumulation.
    data["batch"]["gradient_accumulation_steps"] = accumulation
    space.candidates.append(
        Candidate(
            strategy=strategy,
            micro_batch=micro,
            accumulation=accumulation,
            bucket_mb=bucket,
            recompute=rc,
            comm_dtype=comm,
            mapping=data,
            config=load_config(data),
            precision=prec,
            layout=layout,
        )
    )
