"""The sections that say how the work is spread over ranks and how the ranks talk: the mesh, the
data-parallel strategies (replicate, ZeRO and its offload, parameter servers), pipeline and
tensor parallelism, the collectives and gradient compression."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from longboat.config.sections_base import _Section


class ReplicateConfig(_Section):
    """Bucketed all-reduce data parallelism."""

    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size in MiB")
    first_bucket_mb: float = Field(
        1.0, gt=0, description="size of the first bucket, small so communication starts early"
    )
    overlap_optimizer: bool = Field(
        True,
        description="step the optimizer bucket by bucket as each all-reduce completes "
        "(only without clipping, and only for per-parameter optimizers)",
    )


def swap_path_problem(path: str) -> str | None:
    """What is wrong with ``path`` as a disk offload directory (None when nothing is), said after
    ``<key> = <value>``, fix included.

    [Note: offload path] The path itself may be created, the directories above it never are: a
    mistyped mount point (``/mnt/nvme`` for ``/mnt/nvme0``) would otherwise become a tree of
    new directories on whatever disk holds ``/``, and the swap would fill that disk instead of
    the one meant. Checked when the config loads, on every rank (each loads it), and again by
    the swap when it opens the directory (``strategies/zero/offload.py``)."""
    root = Path(path).absolute()
    if root.exists() and not root.is_dir():
        return "is a file, not a directory: give a directory (it may be created inside one)"
    if not root.parent.is_dir():
        return (
            f"its parent {str(root.parent)!r} does not exist (the path itself is created, not "
            f"the directories above it); create the parent first (mkdir -p {root.parent}), or "
            "give a directory on the disk meant for the swap"
        )
    return None


class OffloadConfig(_Section):
    """Where a ZeRO rank keeps its optimizer state between steps ([Note: optimizer state
    offload] in ``strategies/zero/offload.py``)."""

    _key: ClassVar[str] = "zero.offload_optimizer"
    _what: ClassVar[str] = "the optimizer state"

    device: Literal["none", "cpu", "disk"] = Field(
        "none",
        description="none: with the parameters; cpu: in CPU memory (where the compute device "
        "is the CPU, that is already so); disk: in files under `path`, read back unit by unit "
        "for the optimizer step",
    )
    path: str | None = Field(None, description="disk: a directory for the swap files")
    buffer_count: int = Field(
        2,
        ge=1,
        description="disk: units whose state is in memory at once during the step (the one "
        "stepping and those read ahead of it)",
    )

    @model_validator(mode="after")
    def _disk_needs_a_path(self) -> OffloadConfig:
        if self.device == "disk" and not self.path:
            raise ValueError(
                f"{self._key}.device = 'disk' needs {self._key}.path: a directory on a disk "
                f"with room for {self._what}"
            )
        problem = swap_path_problem(self.path) if self.device == "disk" and self.path else None
        if problem:  # [Note: offload path]
            raise ValueError(f"{self._key}.path = {self.path!r}: {problem}")
        return self


class OffloadParamConfig(OffloadConfig):
    """Where a ZeRO-3 rank keeps its parameter and gradient shards between uses ([Note:
    parameter offload] in ``strategies/zero/shard_swap.py``)."""

    _key: ClassVar[str] = "zero.offload_param"
    _what: ClassVar[str] = "the parameter and gradient shards"

    device: Literal["none", "cpu", "disk"] = Field(
        "none",
        description="none: in memory; cpu: in CPU memory (where the compute device is the CPU, "
        "that is already so); disk: in files under `path`, each unit's parameter shard read "
        "before its gather and its gradient shard written after its reduction (stage 3 only)",
    )


class ZeroConfig(_Section):
    """Sharded data parallelism (ZeRO): stage 1 shards optimizer state, 2 also gradients,
    3 also parameters."""

    stage: Literal[1, 2, 3] = 1
    bucket_mb: float = Field(
        25.0, gt=0, description="stages 1-2: size of the flat buffers gradients are reduced in"
    )
    unit_classes: list[str] = Field(
        default_factory=list,
        description="stage 3: module class names whose instances gather their parameters as "
        "one unit (e.g. ['Block']); empty = the repeated blocks the model declares "
        "(transformers' _no_split_modules), else by size. Containers (ModuleList) cannot be units",
    )
    unit_min_params: int = Field(
        1_000_000,
        gt=0,
        description="stage 3 with no unit_classes: smallest module (in parameters) made a unit; "
        "setting it chooses units by size even where the model declares its blocks",
    )
    prefetch: bool = Field(True, description="stage 3: gather the next unit while this one runs")
    init_method: str | None = Field(
        None,
        description="stage 3, a model built on the meta device: the model's method that "
        "initialises one module, called as model.<name>(module) on each module made (e.g. "
        "'_init_weights'); default: found for transformers models and longboat's GPT, else "
        "each module's reset_parameters()",
    )
    offload_optimizer: OffloadConfig = Field(
        default_factory=OffloadConfig,
        description="where the optimizer state lives between steps (DeepSpeed's offload_optimizer)",
    )
    offload_param: OffloadParamConfig = Field(
        default_factory=OffloadParamConfig,
        description="stage 3: where parameter and gradient shards live between uses "
        "(DeepSpeed's offload_param)",
    )


class MeshConfig(_Section):
    """How the ranks are laid out ([Note: mesh] in ``mesh.py``): pipeline stages x data
    parallelism x tensor parallelism. Leave ``dp`` out to derive it from the world size."""

    pp: int = Field(1, ge=1, description="pipeline stages")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per layer")
    dp: int | None = Field(
        None, ge=1, description="data-parallel ranks; default: what pp and tp leave of the world"
    )
    dp_replicate: int | None = Field(
        None,
        ge=1,
        description="replicas of the sharded model (hybrid sharding: ZeRO within "
        "dp_shard ranks, replicated across dp_replicate); default 1",
    )
    dp_shard: int | None = Field(
        None, ge=1, description="ranks one replica is sharded over; default dp / dp_replicate"
    )


class CommConfig(_Section):
    """The collectives doorway: timeout, desync check and comm log (see docs/diagnostics.md)."""

    timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds a collective may wait for its peers before every "
        "surviving rank reports who did not arrive and exits",
    )
    desync_check: bool = Field(
        True,
        description="share a fingerprint of each collective first, so ranks out of step "
        "fail at once naming the ranks and the difference",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="the data plane's torch.distributed backend: auto = NCCL where CUDA is "
        "usable, else gloo; gloo on GPUs lets several ranks share one GPU (NCCL refuses that)",
    )
    log: bool = Field(False, description="count bytes and time per operation; a table at close")
    log_verbose: bool = Field(False, description="with log: also one line per collective")
    groups: int = Field(
        1,
        ge=1,
        description="process groups per data-parallel axis that gradient buckets (ZeRO "
        "units) spread over round-robin, so their reductions overlap; see "
        "docs/communicators.md",
    )
    hierarchical: bool = Field(
        False,
        description="data-parallel all-reduces in two levels: reduce-scatter within each "
        "node, all-reduce across nodes, all-gather within (strategy replicate)",
    )
    ranks_per_node: int | None = Field(
        None,
        ge=1,
        description="consecutive ranks that count as one node for comm.hierarchical "
        "(default: the launcher's local world size); set it to pretend several nodes on "
        "one machine, for tests and experiments",
    )


class CompressionConfig(_Section):
    """Gradient compression on the data-parallel axis, for ``replicate`` and ``zero`` alike
    (``longboat.comm.compression``, docs/compression.md): each method keeps an error-feedback
    residual per tensor, so what compression drops in one step is sent in the next ones."""

    method: Literal["none", "powersgd", "onebit"] = Field(
        "none",
        description="none: exact all-reduce; powersgd: matrices as rank-`rank` products "
        "(Vogels et al. 2019), vectors exact; onebit: the sign of every element and one scale "
        "per chunk, compressed on the worker and on the server side of the reduction (as in "
        "1-bit Adam)",
    )
    rank: int = Field(4, ge=1, description="powersgd: the rank of each matrix's approximation")
    warmup_steps: int = Field(
        10,
        ge=0,
        description="optimizer steps that all-reduce exactly before compression starts",
    )

    @model_validator(mode="after")
    def _rank_is_for_powersgd(self) -> CompressionConfig:
        if "rank" in self.model_fields_set and self.method != "powersgd":
            raise ValueError(
                f"compression.rank = {self.rank} is for method 'powersgd' (method is "
                f"{self.method!r}); remove it or set compression.method = 'powersgd'"
            )
        return self


class ParameterServerConfig(_Section):
    """Dedicated server ranks (the last ``servers`` of the world) hold the parameters; workers
    push gradients and pull parameters (``longboat.ps``)."""

    servers: int = Field(1, ge=1, description="how many of the world's ranks serve")
    mode: Literal["sync", "async", "ssp"] = Field(
        "sync",
        description="sync: every step averages every worker (= replicate); async: each push "
        "applied when it arrives; ssp: workers at most `staleness` clocks apart",
    )
    staleness: int = Field(2, ge=0, description="ssp: clocks a worker may run ahead (0 = sync)")
    update_on_server: bool = Field(
        True,
        description="servers run the optimizer; false: they only average and workers step "
        "(sync only, as MXNet's update_on_kvstore)",
    )
    heartbeat_s: float = Field(1.0, gt=0, description="how often a worker tells servers it lives")
    dead_after_s: float = Field(
        10.0, gt=0, description="a worker silent this long is dead (dropped in async and ssp)"
    )

    @model_validator(mode="after")
    def _dead_after_a_heartbeat(self) -> ParameterServerConfig:
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError(
                f"parameter_server.dead_after_s = {self.dead_after_s} must exceed heartbeat_s = "
                f"{self.heartbeat_s}, or every worker is dead between two heartbeats"
            )
        return self


#: The schedules that split each backward into an input-gradient and a weight-gradient pass.
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "interleaved-zb")


class PipelineConfig(_Section):
    """How pipeline stages (``mesh.pp > 1``) run a step's micro-batches (the micro-batches are
    ``batch.gradient_accumulation_steps``, as in DeepSpeed)."""

    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "interleaved-zb"] = Field(
        "1f1b",
        description="gpipe, 1f1b (PipeDream-Flush), interleaved (virtual stages), zb-h1 "
        "(1F1B with the backward split, weight gradients filling the idle time) or "
        "interleaved-zb (interleaved with the backward split the same way)",
    )
    virtual_stages: int = Field(
        1, ge=1, description="stages per rank; > 1 with interleaved or interleaved-zb"
    )
    partition: str | list[int] | None = Field(
        None,
        description="measured, parameters, uniform, type:REGEX or boundaries; default: the "
        "model's own, else measured (each layer timed on initialize's example_input; "
        "parameters without one)",
    )


class TensorParallelConfig(_Section):
    """How layers are divided across the ``mesh.tp`` ranks (``longboat.tensor``): a plan maps
    module-name patterns to styles."""

    plan: str | dict[str, str | dict[str, str | int]] = Field(
        "auto",
        description="auto (by the model's class), gpt, gpt2, llama, or a table of module "
        "patterns to styles (colwise, colwise_gather_output, rowwise, sequence, split_sequence, "
        "gather_sequence, replicate; {style='colwise', fused=3} for q|k|v)",
    )
    sequence_parallel: bool = Field(
        False, description="divide the activations between the layers along the sequence"
    )
    sequence_dim: int = Field(1, description="the sequence dimension of the activations")
    divide: dict[str, list[str]] = Field(
        default_factory=dict,
        description="module pattern -> attributes divided by tp (e.g. head counts)",
    )
