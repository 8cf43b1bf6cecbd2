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
arguments (:mod:`longboat.deepspeed.pipe`). The module-level helpers scripts reach for are here
too: ``deepspeed.comm``, ``deepspeed.accelerator.get_accelerator()``,
``deepspeed.utils.RepeatingLoader``, ``deepspeed.checkpointing`` and ``deepspeed.zero.Init`` /
``GatheredParameters``, each in the module of that name. Underneath it is
:func:`longboat.initialize` and its :class:`~longboat.engine.Engine`: the config is read in
DeepSpeed's dialect (``config/deepspeed.py``) or longboat's own, the process group is joined from
the launcher's environment (``longboat run``, torchrun; ``deepspeed``'s own launcher sets the
same variables), and checkpoints are longboat's (they load at any world size and strategy, not
into DeepSpeed).

The engine object is :mod:`longboat.deepspeed.engine`'s, ``init_distributed``
:mod:`longboat.deepspeed.distributed`'s; ``initialize`` is here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longboat.config.deepspeed import looks_like_deepspeed
from longboat.config.errors import ConfigError
from longboat.config.loading import read_mapping
from longboat.config.sections import Config
from longboat.deepspeed import accelerator, checkpointing, comm, pipe, utils, zero
from longboat.deepspeed.distributed import _backend as _backend  # importable where it was
from longboat.deepspeed.distributed import init_distributed
from longboat.deepspeed.engine import DeepSpeedEngine
from longboat.deepspeed.pipe import PipelineModule
from longboat.engine.assembly import initialize as _initialize
from longboat.world import World


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed``, ``--deepspeed_config FILE`` and the
    ``--local_rank`` a launcher may pass."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (longboat)")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable it")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the config file")
    if not any("--local_rank" in a.option_strings for a in parser._actions):
        group.add_argument("--local_rank", type=int, default=-1, help="set by a launcher")
    return parser


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
        section = dict(data.get("mesh") or {})
        if section.get("pp", stages) != stages:
            raise conflict("mesh.pp", section["pp"])
        data["mesh"] = {**section, "pp": stages}
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
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "init_distributed",
    "initialize",
    "pipe",
    "utils",
    "zero",
]
