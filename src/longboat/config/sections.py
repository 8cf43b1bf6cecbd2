"""The configuration's sections: one frozen pydantic model per component, and :class:`Config`,
the whole configuration of a run."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

StrategyName = Literal["auto", "single", "replicate", "zero", "parameter_server"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Section):
    """The batch triple: give any two of the three (or only the micro-batch)."""

    train_batch_size: int | None = Field(None, gt=0, description="global samples per step")
    micro_batch_size: int | None = Field(None, gt=0, description="samples per rank per forward")
    gradient_accumulation_steps: int | None = Field(None, gt=0, description="micro-batches/step")


#: Optimizers longboat provides itself (``longboat.optim``), by the name a config gives them.
OWN_OPTIMIZERS = ("Lamb", "OneBitAdam", "OneBitLamb")
# Those that all-reduce their own momentum after a warm-up ([Note: self-reducing optimizer]).
SELF_REDUCING_OPTIMIZERS = ("OneBitAdam", "OneBitLamb")


class OptimizerConfig(_Section):
    """An optimizer for the engine to build when the user passes none (a ``torch.optim`` name,
    or one of ``OWN_OPTIMIZERS``)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(_Section):
    """An LR scheduler for the engine to build (``torch.optim.lr_scheduler`` name)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


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

    @model_validator(mode="after")
    def _param_offload_needs_stage_3(self) -> ZeroConfig:
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(
                f"zero.offload_param.device = {self.offload_param.device!r} needs zero.stage = 3 "
                f"(got {self.stage}): only stage 3 shards the parameters; set stage = 3 or "
                "remove the key"
            )
        return self


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


_FP16_ONLY = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)


class PrecisionConfig(_Section):
    """Compute precision: the forward runs under autocast in ``dtype`` with the model's fp32
    parameters as master weights; fp16 adds loss scaling (DeepSpeed's rules, see
    :mod:`longboat.precision`)."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = Field(0.0, ge=0, description="fp16: 0 = dynamic, > 0 = this static scale")
    initial_scale_power: int = Field(
        16, ge=0, le=127, description="fp16 dynamic: the scale starts at 2**initial_scale_power"
    )
    loss_scale_window: int = Field(
        1000, gt=0, description="fp16 dynamic: steps in a row without overflow before it doubles"
    )
    hysteresis: int = Field(
        2,
        ge=1,
        description="fp16 dynamic: overflows tolerated before the scale halves "
        "(the hysteresis-th halves it; refilled when the scale doubles)",
    )
    min_loss_scale: float = Field(
        1.0, gt=0, description="fp16 dynamic: never halve below this; an overflow there is an error"
    )
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = Field(
        None,
        description="dtype gradients travel in between ranks (replicate); None = their "
        "own dtype (fp32)",
    )

    @model_validator(mode="after")
    def _fp16_keys_need_fp16(self) -> PrecisionConfig:
        stray = [k for k in _FP16_ONLY if k in self.model_fields_set]
        if stray and self.dtype != "fp16":
            keys = ", ".join(f"precision.{k}" for k in stray)
            raise ValueError(
                f"{keys}: only for dtype 'fp16' (dtype is {self.dtype!r}); remove "
                "or set precision.dtype = 'fp16'"
            )
        return self


class DataConfig(_Section):
    """How :meth:`Engine.loader` shards and orders data."""

    shuffle: bool = True
    remainder: Literal["drop", "pad", "join"] = Field(
        "drop",
        description="samples that do not fill every rank in an epoch's last step: drop them, "
        "pad by repeating samples so every rank has as many batches, or join: each rank keeps "
        "the samples that fall to it, and a rank that runs out of batches first (here, or in "
        "your own iterable through engine.join) shadows the others' collectives with zero "
        "contributions until all are done, each micro-batch's gradient averaged over the ranks "
        "that had one ([Note: joining] in longboat/join.py)",
    )
    num_workers: int = Field(
        0, ge=0, description="worker processes loading batches (0: in the training process)"
    )
    prefetch_factor: int | None = Field(
        None, ge=1, description="batches each worker loads ahead (torch's default: 2)"
    )
    persistent_workers: bool = Field(
        False, description="keep the worker processes from one epoch to the next"
    )

    @model_validator(mode="after")
    def _workers_for_worker_options(self) -> DataConfig:
        for key in ("prefetch_factor", "persistent_workers"):
            if getattr(self, key) not in (None, False) and self.num_workers == 0:
                raise ValueError(
                    f"data.{key} needs worker processes: set data.num_workers to 1 or more, or "
                    f"remove data.{key}"
                )
        return self


class CheckpointConfig(_Section):
    """Checkpoints written by ``engine.save_checkpoint`` (see :mod:`longboat.checkpoint`)."""

    keep_last: int = Field(
        0,
        ge=0,
        description="keep only the newest K complete checkpoints of a directory "
        "(older ones are deleted after each save); 0 = keep all",
    )


class LogConfig(_Section):
    """Console output."""

    progress: bool = True
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class SinkConfig(_Section):
    """A file monitor: it writes under ``output_path/job_name/`` on rank 0."""

    enabled: bool = False
    output_path: str = Field("runs", description="directory the job's folder is created in")
    job_name: str = Field("longboat", description="folder under output_path for this run")


class WandbConfig(_Section):
    """Weights & Biases: the step events as a W&B run (needs the optional ``wandb`` package)."""

    enabled: bool = False
    project: str = Field("longboat", description="the W&B project")
    job_name: str = Field("longboat", description="the run's name")
    group: str | None = Field(None, description="W&B group of runs")
    entity: str | None = Field(None, description="W&B team or user (DeepSpeed's 'team')")
    output_path: str = Field("runs", description="directory W&B writes its run folder under")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: written to output_path only (`wandb sync` uploads it later); "
        "online: sent to the W&B server as well",
    )


class MonitorConfig(_Section):
    """Step events (loss, lr, loss scale, samples/s, tokens/s, step time) reduced across ranks
    and sent to the console, a CSV file, TensorBoard and W&B (see ``docs/monitoring.md``)."""

    every: int = Field(1, gt=0, description="optimizer steps between events")
    console: bool = Field(
        True,
        description="rank-0 progress bar (lines when piped); "
        "log.progress = false also turns it off",
    )
    total_steps: int | None = Field(
        None, gt=0, description="steps of the run, for the ETA; also engine.set_total_steps(n)"
    )
    csv: SinkConfig = Field(default_factory=SinkConfig)
    tensorboard: SinkConfig = Field(default_factory=SinkConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class ProfileConfig(_Section):
    """The step profiler: where a step's wall-clock time goes, and its flops."""

    wall_clock_breakdown: bool = Field(
        False,
        description="time data loading, forward, backward, communication wait, "
        "optimizer and checkpointing per step; a table at close()",
    )
    flops: bool = Field(
        False,
        description="count one step's flops (after a warm-up step) and "
        "report achieved flop/s beside a measured matmul rate",
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
    def _async_updates_on_server(self) -> ParameterServerConfig:
        if self.mode != "sync" and not self.update_on_server:
            raise ValueError(
                f"parameter_server.update_on_server = false with mode = {self.mode!r}: without "
                "a step that waits for every worker there is no mean gradient to hand back, so "
                "the servers must run the optimizer (MXNet's rule); set it to true or use "
                "mode = 'sync'"
            )
        if self.dead_after_s <= self.heartbeat_s:
            raise ValueError(
                f"parameter_server.dead_after_s = {self.dead_after_s} must exceed heartbeat_s = "
                f"{self.heartbeat_s}, or every worker is dead between two heartbeats"
            )
        return self


class PipelineConfig(_Section):
    """How pipeline stages (``mesh.pp > 1``) run a step's micro-batches (the micro-batches are
    ``batch.gradient_accumulation_steps``, as in DeepSpeed)."""

    schedule: Literal["gpipe", "1f1b", "interleaved"] = Field(
        "1f1b", description="gpipe, 1f1b (PipeDream-Flush) or interleaved (virtual stages)"
    )
    virtual_stages: int = Field(1, ge=1, description="stages per rank; > 1 with interleaved")
    partition: str | list[int] | None = Field(
        None,
        description="parameters, uniform, type:REGEX or boundaries; default: the model's own",
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


class ActivationCheckpointingConfig(_Section):
    """Modules whose activations are recomputed in backward instead of kept
    (``longboat.recompute``)."""

    classes: list[str] = Field(
        default_factory=list, description="module class names to recompute, e.g. ['Block']"
    )
    every: int = Field(1, ge=1, description="recompute every k-th matching module (1: all)")
    cpu_checkpointing: bool = Field(
        False,
        description="keep the recomputed modules' inputs in CPU memory between forward and "
        "backward on an accelerator (torch.autograd.graph.save_on_cpu; DeepSpeed's key); "
        "no effect on a CPU device",
    )


class CompileConfig(_Section):
    """``torch.compile`` applied by longboat, block by block, after the strategy is set up
    (``longboat/compile.py``, docs/compile.md). ``compile = true`` is short for
    ``[compile] enabled = true``. The other keys go to ``torch.compile`` as they are."""

    enabled: bool = False
    backend: str = Field("inductor", description="a torch.compile backend name (aot_eager, ...)")
    mode: str | None = Field(
        None,
        description="torch.compile's mode: default, reduce-overhead, max-autotune, "
        "max-autotune-no-cudagraphs (checked by torch at initialize)",
    )
    fullgraph: bool = Field(
        False, description="each compiled block must be one graph (an error at a graph break)"
    )
    dynamic: bool | None = Field(
        None, description="dynamic shapes: None lets torch decide (on a shape change)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="backend options (inductor's config), not with mode"
    )
    classes: list[str] = Field(
        default_factory=list,
        description="module class names compiled one by one (e.g. ['Block']); empty = ZeRO-3's "
        "units, else the blocks the model declares (_no_split_modules), else the whole model",
    )

    @model_validator(mode="after")
    def _mode_or_options(self) -> CompileConfig:
        if self.mode is not None and self.options:
            raise ValueError(
                f"compile.mode = {self.mode!r} with compile.options: torch.compile takes one "
                "of the two (a mode is a set of options); remove one"
            )
        return self


class Config(_Section):
    """The whole configuration of a run."""

    strategy: StrategyName = Field(
        "auto", description="auto = single for one process, replicate otherwise"
    )
    seed: int = 0
    gradient_clipping: float = Field(0.0, ge=0, description="max global grad norm; 0 = off")
    sync_batchnorm: bool = Field(
        False,
        description="batch norm statistics over every data-parallel rank's samples, on any "
        "device and under every strategy (longboat/sync_batchnorm.py)",
    )
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    replicate: ReplicateConfig = Field(default_factory=ReplicateConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    parameter_server: ParameterServerConfig = Field(default_factory=ParameterServerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    compile: CompileConfig = Field(default_factory=CompileConfig)

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_switch(cls, value: Any) -> Any:
        """``compile = true`` (or false): the switch alone, the rest as default."""
        return {"enabled": value} if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _join_where_ranks_can_shadow(self) -> Config:
        """``data.remainder = 'join'`` needs a rank without batches to take part in the others'
        collectives with zero contributions ([Note: joining] in ``longboat/join.py``); where
        that is not how the ranks would have to meet, it is refused with the reason."""
        if self.data.remainder != "join":
            return self
        why = None
        if self.strategy == "parameter_server":
            why = (
                "strategy 'parameter_server': async and ssp workers share no collective, so a "
                "worker whose data ends simply leaves (the servers drop it and the others go "
                "on), and in sync mode the servers average over every worker, not over those "
                "that pushed in a step"
            )
        elif self.mesh.pp > 1:
            why = (
                f"mesh.pp = {self.mesh.pp}: a pipeline runs whole steps through "
                "engine.train_step, its micro-batches passing between the stages, while join "
                "shadows the micro-batch loop (engine(x), backward, step)"
            )
        elif self.mesh.tp > 1:
            why = (
                f"mesh.tp = {self.mesh.tp}: the tensor-parallel peers of a data-parallel rank "
                "share its batches and would run out together, but joining is not built and "
                "tested with tensor parallelism yet"
            )
        elif self.sync_batchnorm:
            why = (
                "sync_batchnorm: its statistics are all-reduced inside every batch-norm "
                "layer's forward and backward, which a rank without a batch does not run"
            )
        if why is None:
            return self
        raise ValueError(
            f"data.remainder = 'join' with {why}; use data.remainder = 'pad' (every rank gets "
            "as many batches) or 'drop'"
        )

    @model_validator(mode="after")
    def _hierarchical_where_it_is_built(self) -> Config:
        """The hierarchical sum is an all-reduce's; ZeRO reduces by reduce-scatter."""
        if self.comm.hierarchical and self.strategy == "zero":
            raise ValueError(
                "comm.hierarchical = true with strategy 'zero': ZeRO reduces gradients by "
                "reduce-scatter, which has no hierarchical form here; set comm.hierarchical = "
                "false (comm.groups still spreads its reductions), or use strategy 'replicate'"
            )
        return self

    @model_validator(mode="after")
    def _onebit_where_it_is_built(self) -> Config:
        """1-bit Adam and 1-bit LAMB all-reduce their own momentum after their warm-up ([Note:
        self-reducing optimizer] in ``optim/self_reducing.py``): only ``replicate`` (or one
        process) lets them, and compressing the gradient as well would compress twice."""
        if self.optimizer is None or self.optimizer.type not in SELF_REDUCING_OPTIMIZERS:
            return self
        name = self.optimizer.type
        if self.strategy in ("zero", "parameter_server"):
            raise ValueError(
                f"optimizer.type = {name!r} with strategy = {self.strategy!r}: {name} "
                "all-reduces each rank's whole momentum itself (DeepSpeed refuses it with ZeRO "
                "too); use strategy = 'replicate', or another optimizer"
            )
        if self.compression.method != "none":
            raise ValueError(
                f"optimizer.type = {name!r} with compression.method = "
                f"{self.compression.method!r}: {name} compresses the momentum itself, the "
                "gradient would be compressed twice; remove the [compression] section"
            )
        return self

    @model_validator(mode="after")
    def _compression_where_it_is_built(self) -> Config:
        """Gradient compression replaces the data-parallel reduction of ``replicate`` and
        ``zero``; what it cannot be combined with (yet) is refused with the reason."""
        method = self.compression.method
        if method == "none":
            return self
        why = None
        if self.strategy == "parameter_server":
            why = "strategy 'parameter_server': its workers push to servers, with no all-reduce"
        elif self.precision.communication_data_type not in (None, "fp32"):
            why = (
                f"precision.communication_data_type = "
                f"{self.precision.communication_data_type!r}: a compressed method chooses what "
                "travels itself; remove one of the two"
            )
        elif self.precision.dtype == "fp16":
            why = (
                "precision.dtype = 'fp16': an overflowing step would leave inf in the "
                "error-feedback residual, which every later step would send; use 'bf16'"
            )
        elif self.data.remainder == "join":
            why = (
                "data.remainder = 'join': a rank without a batch would still send its "
                "error-feedback residual, which is not a zero contribution; use 'pad' or 'drop'"
            )
        elif self.mesh.pp > 1 or self.mesh.tp > 1:
            why = (
                f"mesh.pp = {self.mesh.pp}, mesh.tp = {self.mesh.tp}: compression is built and "
                "tested on plain data parallelism only so far; use mesh.pp = mesh.tp = 1"
            )
        elif self.comm.groups > 1 or self.comm.hierarchical:
            why = (
                f"comm.groups = {self.comm.groups}, comm.hierarchical = "
                f"{str(self.comm.hierarchical).lower()}: compressed reductions travel on the "
                "data-parallel group itself; use comm.groups = 1 and comm.hierarchical = false"
            )
        if why is None:
            return self
        raise ValueError(f"compression.method = {method!r} with {why}")

    def service_ranks(self) -> int:
        """Ranks at the end of the world that serve instead of training (parameter servers,
        see ``longboat.ps.service``); the mesh covers the others."""
        return self.parameter_server.servers if self.strategy == "parameter_server" else 0

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel ranks at ``world_size``: ``mesh.dp``, or what ``mesh.pp`` and
        ``mesh.tp`` leave of the ranks that train (the full check of the mesh is
        ``longboat.mesh.Mesh.resolve``)."""
        m = self.mesh
        workers = world_size - self.service_ranks()
        return m.dp if m.dp is not None else max(workers // (m.pp * m.tp), 1)

    def resolved_strategy(self, world_size: int) -> str:
        """The strategy actually used at this world size."""
        if self.strategy == "auto":
            return "single" if world_size == 1 else "replicate"
        return self.strategy
