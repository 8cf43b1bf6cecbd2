"""DeepSpeed's call sites on longboat: a DeepSpeed training loop runs with one import changed.

[Note: DeepSpeed call sites] ``import longboat.deepspeed as deepspeed`` gives a script written
for DeepSpeed what it calls: ``deepspeed.add_config_arguments(parser)`` and
``deepspeed.initialize(args=..., model=..., model_parameters=..., training_data=...,
config=...)`` returning ``(engine, optimizer, training_dataloader, lr_scheduler)``; the engine
answers ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``, ``engine.train_batch()``,
``save_checkpoint(dir, tag, client_state)``, ``load_checkpoint(dir, tag)`` returning ``(path,
client_state)``, ``engine.module``, ``global_steps``, ``get_lr()`` and the batch getters, with
DeepSpeed's meanings; ``deepspeed.init_distributed()`` before them joins the process group, and
``deepspeed.pipe`` (also ``deepspeed.PipelineModule``) builds a pipeline model with DeepSpeed's
arguments (:mod:`longboat.deepspeed.pipe`). Underneath it is :func:`longboat.initialize` and its
:class:`~longboat.engine.Engine`: the config is read in DeepSpeed's dialect
(``config/deepspeed.py``) or longboat's own, the process group is joined from the launcher's
environment (``longboat run``, torchrun; ``deepspeed``'s own launcher sets the same variables),
and checkpoints are longboat's (they load at any world size and strategy, not into DeepSpeed).
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longboat.config.deepspeed import looks_like_deepspeed
from longboat.config.errors import ConfigError
from longboat.config.loading import read_mapping
from longboat.config.sections import Config
from longboat.deepspeed import pipe
from longboat.deepspeed.pipe import PipelineModule
from longboat.engine import Engine
from longboat.engine import initialize as _initialize
from longboat.world import World, before_group, default_backend, destroy_process_group
from longboat.world import init_process_group as _join_group

log = logging.getLogger("longboat")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed``, ``--deepspeed_config FILE`` and the
    ``--local_rank`` a launcher may pass."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (longboat)")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable it")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the config file")
    if not any("--local_rank" in a.option_strings for a in parser._actions):
        group.add_argument("--local_rank", type=int, default=-1, help="set by a launcher")
    return parser


# The backends DeepSpeed's accelerators name, by the device each needs: a script written for one
# of them (``hccl`` for Ascend NPUs, ``ccl``/``xccl`` for Intel GPUs) names it even on a machine
# that has none. longboat computes on CUDA GPUs and CPUs, so there the backend follows the device
# as longboat's own initialize chooses it, and the substitution is logged, not silent.
_OTHER_ACCELERATORS = {"hccl": "an Ascend NPU", "ccl": "an Intel GPU", "xccl": "an Intel GPU"}


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's ``deepspeed.init_distributed``: join the default process group as
    :func:`longboat.initialize` would, from the launcher's environment (``longboat run``,
    torchrun, DeepSpeed's launcher, Slurm, Open MPI; ``auto_mpi_discovery`` needs no mpi4py
    here), once: a later call, and ``initialize`` afterwards, use the group that exists. A world
    of one (plain ``python script.py``) needs no group.

    ``dist_backend``: ``nccl``, ``gloo`` or ``mpi`` as torch has them; None is NCCL beside a
    GPU and gloo otherwise. An accelerator's backend that this machine cannot run (``hccl``,
    ``ccl``, ``xccl``, or ``nccl`` without a GPU) becomes that default, with a log line.
    ``distributed_port`` is the port when the environment names none; ``timeout`` bounds each
    collective; ``init_method`` (``tcp://``, ``file://``) with ``rank`` and ``world_size``
    joins without a launcher; ``dist_init_required=False`` only checks that a group exists.
    ``config`` is accepted as DeepSpeed's is here, for its comms logging: the config given to
    :func:`initialize` sets longboat's (``comms_logger``)."""
    del verbose, config  # logging is longboat's; see the docstring for config
    if dist_init_required is False:
        if not dist.is_initialized():
            raise ConfigError(
                "deepspeed.init_distributed(dist_init_required=False): no process group exists; "
                "create one first, or leave dist_init_required at None"
            )
        return
    if dist.is_initialized():  # idempotent, as DeepSpeed's: the group that exists is kept
        return
    if not isinstance(timeout, datetime.timedelta):
        raise ConfigError(f"init_distributed(timeout={timeout!r}) must be a datetime.timedelta")
    env = dict(os.environ)
    env.setdefault("MASTER_PORT", str(distributed_port))
    world = World.from_env(env)
    backend = _backend(dist_backend, world)
    if init_method not in (None, "env://"):
        _join_by_url(init_method, backend, rank, world_size, timeout)
        return
    for name, given, have in (
        ("rank", rank, world.rank),
        ("world_size", world_size, world.world_size),
    ):
        if given not in (-1, have):
            raise ConfigError(
                f"deepspeed.init_distributed({name}={given}): the launcher's environment says "
                f"{name} {have} ({world.source}); leave it at -1, or give init_method='tcp://...' "
                "to join without a launcher"
            )
    if _join_group(world, backend, timeout.total_seconds()):
        # The group outlives the engine (its close() leaves a group it did not create), so it
        # is left at exit, as a Horovod script's is: see [Note: dynamo before the group].
        atexit.register(destroy_process_group)


def _backend(name: str | None, world: World) -> str | None:
    """The backend to create for ``dist_backend=name`` (None: longboat's default)."""
    if name is None:
        return None
    name = name.lower()
    gpu = torch.cuda.is_available()
    if name == "gloo" or (name == "nccl" and gpu and dist.is_nccl_available()):
        return name
    if name == "mpi":
        if not dist.is_mpi_available():
            raise ConfigError(
                "deepspeed.init_distributed(dist_backend='mpi'): this torch is built without "
                "MPI; leave dist_backend at None (NCCL beside a GPU, gloo otherwise)"
            )
        return name
    if name in _OTHER_ACCELERATORS or name == "nccl":
        chosen = default_backend()
        if world.is_main and world.distributed:
            needs = _OTHER_ACCELERATORS.get(name, "a CUDA GPU")
            log.warning(
                "deepspeed.init_distributed(dist_backend=%r): that backend needs %s, which "
                "this machine does not give longboat; using %s for its %s",
                name,
                needs,
                chosen,
                "GPUs" if gpu else "CPU",
            )
        return chosen
    raise ConfigError(
        f"deepspeed.init_distributed(dist_backend={name!r}): {name!r} is not a backend "
        "longboat can use; give 'nccl', 'gloo' or 'mpi', or None for the device's default"
    )


def _join_by_url(
    url: str, backend: str | None, rank: int, world_size: int, timeout: datetime.timedelta
) -> None:
    """Join with torch's ``init_method`` URL, as DeepSpeed passes it on: the URL and the two
    numbers say everything, no launcher's environment is read."""
    if rank < 0 or world_size < 1:
        raise ConfigError(
            f"deepspeed.init_distributed(init_method={url!r}) needs rank=... and world_size=..."
        )
    before_group()
    dist.init_process_group(
        backend or default_backend(),
        init_method=url,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    atexit.register(destroy_process_group)


class DeepSpeedEngine:
    """A longboat :class:`~longboat.engine.Engine` behind DeepSpeed's engine methods."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.training_dataloader: Any = None  # set by initialize() from training_data
        self._data_iter: Iterator[Any] | None = None  # train_batch()'s own, over that loader
        self._applied = True  # whether the last optimizer step was applied

    # -- training ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        """The optimizer step at an accumulation boundary; between boundaries nothing (as
        DeepSpeed's ``step()``, called after every micro-batch)."""
        skipped = self.engine.skipped_steps
        if self.engine.step():
            self._applied = self.engine.skipped_steps == skipped

    def train_batch(
        self, data_iter: Iterator[Any] | None = None, loss_fn: Callable[..., Any] | None = None
    ) -> torch.Tensor:
        """One optimizer step on ``gradient_accumulation_steps()`` micro-batches drawn from
        ``data_iter`` (default: the ``training_data`` loader given to :func:`initialize`), each
        an ``(inputs, labels)`` pair, the loss ``loss_fn(outputs, labels)`` (default: the
        module's ``loss_fn``, as DeepSpeed's ``PipelineModule`` has); returns the mean loss.
        Runs through the pipeline schedule when ``mesh.pp > 1``."""
        loss_fn = loss_fn or getattr(self.module, "loss_fn", None)
        if loss_fn is None:
            raise ConfigError(
                "train_batch() needs a loss: give loss_fn=..., or set the module's loss_fn "
                "attribute (DeepSpeed's PipelineModule(loss_fn=...))"
            )
        if data_iter is None:
            if self.training_dataloader is None:
                raise ConfigError(
                    "train_batch() without data_iter needs training_data given to initialize()"
                )
            if self._data_iter is None:
                self._data_iter = iter(_repeating(self.training_dataloader))
            data_iter = self._data_iter
        micro = list(itertools.islice(data_iter, self.gradient_accumulation_steps()))
        if len(micro) < self.gradient_accumulation_steps():
            raise StopIteration("data_iter ran out within a step")
        batch = tuple(torch.cat(parts) for parts in zip(*micro, strict=True))
        mean = self.engine.train_step(batch, lambda out, mb: loss_fn(out, mb[1]))
        return torch.tensor(mean)

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: Any = None,
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable[..., Any] | None = None,
        num_local_io_workers: int | None = None,
    ) -> Any:
        """This rank's micro-batches of ``dataset`` (longboat's sharded, resumable loader),
        batched by ``collate_fn`` (default: torch's). ``route``, ``pin_memory`` and
        ``num_local_io_workers`` change how batches are fetched, not which; a ``batch_size``
        other than the micro-batch and a ``data_sampler`` are refused (the loader shards by
        the mesh's data-parallel ranks itself)."""
        del route, pin_memory, num_local_io_workers  # see the docstring
        micro = self.train_micro_batch_size_per_gpu()
        if batch_size not in (None, micro):
            raise ConfigError(
                f"deepspeed_io(batch_size={batch_size}): the micro-batch is {micro} "
                "(train_micro_batch_size_per_gpu); leave batch_size out"
            )
        if data_sampler is not None:
            raise ConfigError(
                "deepspeed_io(data_sampler=...) is not supported: longboat's loader shards the "
                "data set by rank and reshuffles each epoch itself; leave it out"
            )
        return self.engine.loader(dataset, collate_fn=collate_fn)

    def train(self, mode: bool = True) -> DeepSpeedEngine:
        self.engine.train(mode)
        return self

    def eval(self) -> DeepSpeedEngine:
        self.engine.eval()
        return self

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save under ``save_dir/tag`` (default tag: ``global_step<N>``, DeepSpeed's); every
        rank calls it. A checkpoint saved is the latest one, and holds every parameter (so it
        loads at any layout): ``save_latest=False`` and ``exclude_frozen_parameters=True`` are
        refused."""
        if not save_latest or exclude_frozen_parameters:
            name = "save_latest=False" if not save_latest else "exclude_frozen_parameters=True"
            raise ConfigError(
                f"save_checkpoint({name}) is not supported: a longboat checkpoint is whole and "
                "the newest is the latest; leave it at its default"
            )
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        self.engine.save_checkpoint(save_dir, tag, client_state or {})
        return True

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, Any]:
        """Load ``load_dir/tag`` (default: the latest); ``(path, client_state)``, or ``(None,
        None)`` when there is none, as DeepSpeed returns. Everything saved is loaded, by
        longboat's verified loader: the flags that would load less, and a ``custom_load_fn``,
        are refused when given."""
        given = {
            "load_module_strict": load_module_strict,
            "load_optimizer_states": load_optimizer_states,
            "load_lr_scheduler_states": load_lr_scheduler_states,
            "load_module_only": load_module_only,
            "custom_load_fn": custom_load_fn,
        }
        default = {**dict.fromkeys(given, True), "load_module_only": False, "custom_load_fn": None}
        for name, value in given.items():
            if value != default[name]:
                shown = "..." if name == "custom_load_fn" else value
                raise ConfigError(
                    f"load_checkpoint({name}={shown}) is not supported: longboat checkpoints "
                    "load whole; leave it at its default"
                )
        loaded = self.engine.load_checkpoint(
            load_dir, None if tag is None else str(tag), allow_missing=True
        )
        if loaded is None:
            return None, None
        return str(loaded.path), loaded.client_state

    # -- what DeepSpeed's engine reports -------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.scheduler

    @property
    def global_steps(self) -> int:
        return self.engine.global_step

    @property
    def global_samples(self) -> int:
        return self.engine.global_step * self.train_batch_size()

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_step

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def global_rank(self) -> int:
        return self.engine.world.rank

    @property
    def local_rank(self) -> int:
        return self.engine.world.local_rank

    @property
    def world_size(self) -> int:
        return self.engine.world.world_size

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.engine.optimizer.param_groups]

    def train_batch_size(self) -> int:
        return self.engine.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine.batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_boundary

    def zero_optimization_stage(self) -> int:
        cfg = self.engine.config
        return cfg.zero.stage if self.engine.strategy.name.startswith("zero") else 0

    def was_step_applied(self) -> bool:
        """False when the last optimizer step was skipped for an fp16 overflow."""
        return self._applied

    def destroy(self) -> None:
        self.engine.close()


def _repeating(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches epoch after epoch (DeepSpeed's ``RepeatingLoader``)."""
    while True:
        yield from loader


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, Any, Any]:
    """DeepSpeed's ``deepspeed.initialize``: ``(engine, optimizer, training_dataloader,
    lr_scheduler)``. The config is ``config`` (a dict or a path), else ``config_params``, else
    ``args.deepspeed_config``; the optimizer is ``optimizer`` (or a callable given
    ``model_parameters``), else the config's ``optimizer`` block over ``model_parameters``;
    ``lr_scheduler`` may be a scheduler or a callable given the optimizer; ``collate_fn``
    batches ``training_data``. The process group is joined as :func:`longboat.initialize`
    joins it (the config's ``comm`` section chooses the backend), ``distributed_port`` being
    the port where the environment names none; ``dist_init_required=False`` requires a group
    to exist. ``mpu`` and ``mesh_param`` (Megatron's and DeepSpeed's own layouts of the ranks)
    are refused: the mesh is the config's ``mesh`` section here."""
    if model is None:
        raise ConfigError("deepspeed.initialize() needs model=...")
    for name, given in (("mpu", mpu), ("mesh_param", mesh_param)):
        if given is not None:
            raise ConfigError(
                f"deepspeed.initialize({name}=...) is not supported: longboat lays out the "
                "ranks from the config's mesh section (mesh.tp, mesh.pp, mesh.dp_replicate); "
                "leave it out"
            )
    if dist_init_required is False:
        init_distributed(dist_init_required=False)  # refuses where no group exists
    # the port where the environment names none, as DeepSpeed's MPI discovery sets it
    if (
        "MASTER_PORT" not in os.environ
        and not dist.is_initialized()
        and World.from_env().distributed
    ):
        os.environ["MASTER_PORT"] = str(distributed_port)
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ConfigError(
            "deepspeed.initialize() needs a config: config=..., config_params=... or "
            "args.deepspeed_config (add_config_arguments(parser), --deepspeed_config FILE)"
        )
    params = list(model_parameters) if model_parameters is not None else None
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params if params is not None else model.parameters())
    if optimizer is None and params is not None and not _all_of(params, model):
        raise ConfigError(
            "deepspeed.initialize(model_parameters=...) names a subset or groups of the "
            "model's parameters: build the optimizer yourself and pass optimizer=..."
        )
    scheduler = lr_scheduler
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        if optimizer is None:
            raise ConfigError(
                "a callable lr_scheduler needs the optimizer: pass optimizer=... as well"
            )
        scheduler = lr_scheduler(optimizer)
    if isinstance(model, PipelineModule):
        config = _with_stages(config, model)
    engine = _initialize(model, optimizer, config, scheduler=scheduler)
    ds = DeepSpeedEngine(engine)
    loader = None
    if training_data is not None:
        loader = ds.deepspeed_io(training_data, collate_fn=collate_fn)
    ds.training_dataloader = loader
    return ds, engine.optimizer, loader, engine.scheduler


def _with_stages(config: Any, model: PipelineModule) -> Any:
    """``config`` with the module's ``num_stages`` as its pipeline stages (``mesh.pp``), and a
    DeepSpeed config's ``pipeline.activation_checkpoint_interval`` moved onto the module, where
    DeepSpeed's pipeline engine puts it too (when above 0, it replaces the module's)."""
    stages = model.num_stages

    def conflict(key: str, value: Any) -> ConfigError:
        return ConfigError(
            f"config key '{key}' = {value!r} and PipelineModule(num_stages={stages}) disagree; "
            "give the same number of stages, or leave the key out"
        )

    if isinstance(config, Config):
        if "pp" in config.mesh.model_fields_set and config.mesh.pp != stages:
            raise conflict("mesh.pp", config.mesh.pp)
        mesh = config.mesh.model_copy(update={"pp": stages})
        return config.model_copy(update={"mesh": mesh})
    data = dict(read_mapping(config) if isinstance(config, (str, Path)) else config)
    if looks_like_deepspeed(data):
        block = dict(data.get("pipeline") or {})
        interval = block.pop("activation_checkpoint_interval", 0)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise ConfigError(
                f"DeepSpeed key 'pipeline.activation_checkpoint_interval' = {interval!r} must be "
                "a whole number of layers, 0 for none"
            )
        if interval > 0:
            model.activation_checkpoint_interval = interval
        if block.get("stages", "auto") not in ("auto", stages):
            raise conflict("pipeline.stages", block["stages"])
        data["pipeline"] = {**block, "stages": stages}
    else:
        mesh = dict(data.get("mesh") or {})
        if mesh.get("pp", stages) != stages:
            raise conflict("mesh.pp", mesh["pp"])
        data["mesh"] = {**mesh, "pp": stages}
    return data


def _all_of(params: list[Any], model: nn.Module) -> bool:
    """Whether ``params`` are exactly the model's trainable parameters, ungrouped."""
    if any(isinstance(p, dict) for p in params):
        return False
    mine = {id(p) for p in model.parameters() if p.requires_grad}
    return {id(p) for p in params} == mine


__all__ = [
    "DeepSpeedEngine",
    "PipelineModule",
    "add_config_arguments",
    "init_distributed",
    "initialize",
    "pipe",
]
