"""Building an engine: joining the process group, the mesh, this rank's pipeline stages,
tensor-parallel layers, the optimizer and the strategy, in that order."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from longboat import sync_batchnorm
from longboat.compile import Compiler, unwrap
from longboat.config.batch import resolve_batch
from longboat.config.errors import ConfigError
from longboat.config.loading import load_config
from longboat.config.override import overridden
from longboat.config.sections import Config
from longboat.engine.core import Engine
from longboat.mesh import Mesh, MeshError
from longboat.observe.log import setup_logging
from longboat.optim import build_optimizer, build_scheduler
from longboat.pipeline import build_schedule
from longboat.recompute import apply_activation_checkpointing
from longboat.recovery.injob import Batch, replacement_world, replacing
from longboat.strategies.registry import build_service
from longboat.tensor import TensorParallel
from longboat.topology import DoorwayOptions, Topology
from longboat.world import World, device_for, init_process_group


def seed_everything(seed: int) -> None:
    """Seed Python, torch (and numpy if present) the same way on every rank."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | Mapping[str, Any] | str | Path | None = None,
    *,
    scheduler: LRScheduler | None = None,
    world: World | None = None,
    param_init_fn: Callable[[nn.Module], object] | None = None,
    example_input: Any = None,
) -> Engine:
    """Make ``model`` train under the strategy the config asks for.

    The process group is joined if the environment describes one (``longboat run``, torchrun,
    Slurm, Open MPI) and none exists yet; plain ``python script.py`` is a world of one.
    ``optimizer`` and ``scheduler`` may come from the config's ``optimizer``/``scheduler``
    sections instead.

    ``param_init_fn(module)`` (FSDP's name) initialises, in place, the parameters and buffers
    of each module of a model built on the meta device, as ZeRO-3 makes them real; without it
    the model's own initialiser does (``zero.init_method``, found by itself for transformers
    models and :class:`longboat.models.GPT`), else each module's ``reset_parameters()``
    ([Note: deferred init] in ``longboat/strategies/zero/init.py``).

    ``example_input`` is one micro-batch's positional inputs to the model (a tensor, or a
    tuple of them): with pipeline stages, the default partition times each layer on it and
    splits the layers so that the slowest stage is as fast as it can be
    (``docs/pipeline.md``); without it, the stages balance parameters.
    """
    cfg, world, owns, service, mesh, options, batch = _join(config, world)
    if service is None:
        topology = Topology.build(mesh, options, device_for(world))
    else:
        service.start(cfg.comm.timeout_s)
        if service.serves(world.rank):  # serves, then ends the process (ServerExit)
            service.serve(_optimizer_of(model, optimizer, cfg), mesh, options)
        topology = service.topology(mesh, options, device_for(world))
    engine = assemble(
        model,
        optimizer,
        cfg,
        world,
        topology,
        scheduler,
        owns_group=owns,
        service=service,
        param_init_fn=param_init_fn,
        example_input=example_input,
    )
    if replacing(cfg):  # built alone: now taken into the job ([Note: joining a replacement])
        engine._take_place(options, batch)
    return engine


def _join(
    config: Config | Mapping[str, Any] | str | Path | None, world: World | None
) -> tuple[Config, World, bool, Any, Mesh, DoorwayOptions, Batch | None]:
    """The config, the world (joined), the ranks that serve beside the mesh, the mesh, the
    doorways' options, and a replacement's batch under hybrid sharding."""
    cfg = overridden(load_config(config))  # [Note: config override]
    world = world or World.from_env()
    setup_logging(world, cfg.log.level)
    batch = None
    if replacing(cfg):
        # A replacement of a dead replica builds its engine alone (its rank at launch kept, so
        # that logs and monitors say who it is), or with the other joiners of its replica
        # under hybrid sharding, and joins the members' group afterwards: they are mid-run and
        # take no part in what building an engine communicates.
        world, batch = replacement_world(cfg, world)
    c = cfg.comm
    prefix = batch.prefix if batch is not None else ""
    owns = init_process_group(world, c.backend, c.timeout_s, store_prefix=prefix)
    # Ranks that serve the strategy instead of training ([Note: parameter server roles] in
    # ps/service.py): the mesh covers the others.
    service = build_service(cfg, world.world_size)
    if batch is None:
        mesh = resolve_mesh(cfg, world.world_size - cfg.service_ranks())
    else:  # one shard group: the replica it will be
        mesh = Mesh.resolve(batch.size, dp_shard=batch.size)
    options = DoorwayOptions(
        desync_check=c.desync_check,
        log=c.log,
        log_verbose=c.log_verbose,
        timeout_s=c.timeout_s,
        groups=c.groups,
        hierarchical=c.hierarchical,
        ranks_per_node=c.ranks_per_node or world.local_world_size,
    )
    return cfg, world, owns, service, mesh, options, batch


def serve_beside(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | Mapping[str, Any] | str | Path | None = None,
) -> Any:
    """On a server rank of a parameter-server job, what :func:`initialize` does there, but the
    serving runs in a thread of its own and this returns it (its ``summary`` is set when the
    workers have left), so that the process goes on with other work: ``longboat bench`` runs
    that rank's share of the other sides meanwhile. Every other rank calls :func:`initialize`.
    """
    cfg, world, _, service, mesh, options, _ = _join(config, None)
    if service is None or not service.serves(world.rank):
        raise ConfigError(
            f"serve_beside on rank {world.rank}: the config's strategy is {cfg.strategy!r}, "
            "and only a parameter server's server ranks serve; call longboat.initialize"
        )
    service.start(cfg.comm.timeout_s)
    return service.serve_beside(_optimizer_of(model, optimizer, cfg), mesh, options)


def _optimizer_of(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, cfg: Config
) -> torch.optim.Optimizer:
    """The user's optimizer, or the one the config describes."""
    if optimizer is not None:
        return optimizer
    if cfg.optimizer is None:
        raise ConfigError(
            "no optimizer: pass one to longboat.initialize, or set the "
            "config's 'optimizer' section, e.g. {type='AdamW', params={lr=1e-3}}"
        )
    return build_optimizer(model.parameters(), cfg.optimizer)


def assemble(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    cfg: Config,
    world: World,
    topology: Topology,
    scheduler: LRScheduler | None = None,
    owns_group: bool = False,
    device: torch.device | None = None,
    service: Any = None,
    param_init_fn: Callable[[nn.Module], object] | None = None,
    example_input: Any = None,
) -> Engine:
    """The engine of ``model`` on ``topology``: this rank's pipeline stages, activation
    checkpointing, the optimizer (the user's restricted to the stages held, or the config's)
    and the strategy, on ``device`` (default: this rank's). :func:`initialize` after joining
    the group; ``longboat plan`` on its simulated topology, on CPU fake tensors, so a plan is
    of exactly what a run builds."""
    device = device or device_for(world)
    # [Note: compiling under a strategy] in compile.py: a compiled model is set up as
    # itself (names and checkpoints stay the user's), and compiled once the strategy's hooks
    # are in place; bad settings are refused now, before anything else is built.
    model, compiled = unwrap(model)
    compiler = Compiler.plan(cfg.compile, compiled)
    # The step's micro-batches (the engine resolves the batch again and refuses a bad one): the
    # measured split is the one the schedule runs fastest with that many.
    micro_batches = resolve_batch(cfg.batch, topology.mesh.dp).gradient_accumulation_steps
    schedule = build_schedule(cfg.pipeline, topology, device, micro_batches)
    # With pipeline stages, this rank's stages only, from here on (specs built here).
    model = schedule.prepare(model, example_input)
    # Then tensor parallelism divides the layers the plan names (before the optimizer is built
    # from the parameters, which keep their objects: a user's optimizer stays valid).
    tensor = TensorParallel(
        cfg.tensor_parallel, topology.data("tp"), check_unused=topology.mesh.pp == 1
    )
    tensor.apply(model, device)
    if cfg.sync_batchnorm:  # [Note: sync batchnorm]: before the strategy sees the modules
        n = sync_batchnorm.convert(model, topology.data("dp"))
        logging.getLogger("longboat").log(
            logging.INFO if n else logging.WARNING,
            "sync_batchnorm: %d batch norm layer(s) synchronised over the data-parallel ranks",
            n,
        )
    apply_activation_checkpointing(model, cfg.activation_checkpointing, device)
    # The model goes to the device once its strategy is built (in Engine): a strategy may
    # place the parameters itself ([Note: placing parameters] in strategies/zero/init.py).
    if optimizer is None:
        optimizer = _optimizer_of(model, None, cfg)
    else:
        schedule.restrict(optimizer, model)
    if scheduler is None and cfg.scheduler is not None:
        scheduler = build_scheduler(optimizer, cfg.scheduler)
    engine = Engine(
        model,
        optimizer,
        cfg,
        world,
        topology,
        scheduler,
        owns_group=owns_group,
        schedule=schedule,
        tensor=tensor,
        service=service,
        param_init_fn=param_init_fn,
        device=device,
    )
    if compiler is not None:
        hooked = engine.strategy.hooked_modules()
        compiler.apply(engine.module, hooked, engine.tensor.active)
        engine.compiler = compiler
    return engine


def resolve_mesh(cfg: Config, world_size: int) -> Mesh:
    """The config's ``[mesh]`` at ``world_size`` ranks."""
    m = cfg.mesh
    try:
        mesh = Mesh.resolve(
            world_size, pp=m.pp, tp=m.tp, dp=m.dp, dp_replicate=m.dp_replicate, dp_shard=m.dp_shard
        )
    except MeshError as e:
        raise ConfigError(str(e)) from None
    return mesh
