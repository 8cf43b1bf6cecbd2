"""The training step: forward, backward, accumulation boundary, clipping, optimizer, scheduler.

Everything that depends on how state is distributed belongs to the strategy; the engine only
sequences the step.
"""

from __future__ import annotations

import atexit
import logging
import random
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from longboat import checkpoint
from longboat.comm.collectives import Collectives
from longboat.config import Config, ConfigError, ResolvedBatch, load_config, resolve_batch
from longboat.data import ShardedLoader, make_loader
from longboat.grads import clip_by_global_norm_
from longboat.observe.log import setup_logging
from longboat.observe.memory import (
    MemoryReport,
    expected_bytes,
    measure,
    optimizer_state_bytes_per_param,
)
from longboat.observe.monitor import Monitor
from longboat.optim import build_optimizer, build_scheduler, check_parameters
from longboat.precision import Precision, SkippedStep
from longboat.strategies import StrategyContext, build_strategy
from longboat.world import World, destroy_process_group, device_for, init_process_group


class Engine:
    """A model trained by a strategy. Create it with :func:`longboat.initialize`."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: Config,
                 world: World, comm: Collectives, scheduler: LRScheduler | None = None,
                 owns_group: bool = False) -> None:
        self.config = config
        self.world = world
        self.comm = comm
        self.model = model  # the user's module, parameter names unchanged
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.batch: ResolvedBatch = resolve_batch(config.batch, comm.world_size)
        check_parameters(model, optimizer)
        # Counted before the strategy may shard the parameters away.
        self.trainable_params = sum(p.numel() for p in dict.fromkeys(model.parameters())
                                    if p.requires_grad)
        # Names, full shapes and dtypes (the model fingerprint), also before any sharding.
        self.checkpointing = checkpoint.Checkpointing(model)
        self.strategy = build_strategy(config.resolved_strategy(comm.world_size),
                                       StrategyContext(world, comm, config))
        self.module = self.strategy.setup(model, optimizer)
        self.precision = Precision(config.precision, device_for(world))
        self.micro_step = 0
        self.global_step = 0  # optimizer steps taken or skipped (as DeepSpeed's global_steps)
        self.skipped_steps = 0  # fp16 steps skipped for a gradient overflow
        self.last_grad_norm: torch.Tensor | None = None
        self._loss_sum = 0.0
        self._loss_count = 0
        self._owns_group = owns_group
        self._closed = False
        self.log = logging.getLogger("longboat")
        self.monitor = Monitor(config, comm, is_main=world.is_main,
                               train_batch_size=self.batch.train_batch_size,
                               optimizer=optimizer, device=device_for(world),
                               loss_scale=lambda: self.precision.loss_scale
                               if self.precision.checks_overflow else None)
        self.log.info("strategy %s on %d rank(s); batch: %d per step = micro %d x accumulation "
                      "%d x data-parallel %d", self.strategy.name, comm.world_size,
                      self.batch.train_batch_size, self.batch.micro_batch_size,
                      self.batch.gradient_accumulation_steps, comm.world_size)
        if self.precision.describe():
            self.log.info("precision %s", self.precision.describe())
        # Leave the process group at exit even if the script never calls close(); a weak
        # reference so that an engine dropped early is not kept alive by the registry.
        ref = weakref.ref(self)
        self._atexit = lambda: (e := ref()) is not None and e.close()
        atexit.register(self._atexit)

    # -- the step ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through the model (under autocast unless fp32; floating outputs in fp32)."""
        self.monitor.forward_begin(self.global_step, args, kwargs)
        with self.monitor.phase("forward"):
            self.strategy.before_forward()
            with self.precision.autocast():
                out = self.module(*args, **kwargs)
        return self.precision.cast_output(out)

    forward = __call__

    @property
    def accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    @property
    def is_boundary(self) -> bool:
        """True when the next :meth:`backward` completes an optimizer step's gradients."""
        return (self.micro_step + 1) % self.accumulation_steps == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled for accumulation, and by the fp16 loss scale);
        synchronises at the boundary."""
        with self.monitor.phase("backward"):
            self.strategy.before_backward(sync=self.is_boundary)
            self.precision.scale(loss / self.accumulation_steps).backward()
            self.strategy.after_backward()
        self._loss_sum += float(loss.detach())
        self._loss_count += 1
        self.micro_step += 1

    def step(self) -> bool:
        """At the accumulation boundary: unscale and check (fp16), clip, optimizer step, zero
        grads, scheduler.

        Between boundaries it does nothing and returns False, so it can be called after every
        micro-batch, as with DeepSpeed. At a boundary it returns True, also when an fp16
        overflow made every rank skip the step: then no parameter, optimizer state or scheduler
        moves, ``skipped_steps`` grows and ``global_step`` still counts it (as in DeepSpeed).
        """
        if self.micro_step == 0 or self.micro_step % self.accumulation_steps:
            return False
        with self.monitor.phase("optimizer"):
            self._optimizer_step()
        self.global_step += 1
        loss = self._loss_sum / self._loss_count if self._loss_count else None
        self._loss_sum, self._loss_count = 0.0, 0
        self.last_loss = loss
        self.monitor.step_end(self.global_step, loss)
        return True

    def _optimizer_step(self) -> None:
        self.strategy.finish_gradients()
        skip = False
        if self.precision.checks_overflow or self.config.gradient_clipping > 0:
            # Both need every gradient; without them the strategy may overlap the optimizer
            # with the communication still in flight.
            self.strategy.wait_gradients()
            grads = self.strategy.local_gradients()
            skip = self.precision.unscale_and_check(grads, self.comm)  # same on every rank
            self.precision.update(skip, self.global_step + 1)
            if self.config.gradient_clipping > 0 and not skip:
                self.last_grad_norm = clip_by_global_norm_(
                    grads, self.config.gradient_clipping, self.comm, self.strategy.grads_sharded)
        # A skipped step still runs the strategy's step bookkeeping ([Note: skipped step]).
        self.strategy.optimizer_step(SkippedStep(self.optimizer) if skip else self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += skip
        if self.scheduler is not None and not skip:
            self.scheduler.step()

    def set_total_steps(self, total: int) -> None:
        """Tell the console how many optimizer steps the run takes (for its ETA)."""
        self.monitor.set_total_steps(total)

    # -- data ----------------------------------------------------------------------------------

    def loader(self, dataset: Dataset, *, shuffle: bool | None = None,
               collate_fn: Callable[..., Any] | None = None) -> ShardedLoader:
        """This rank's shard of ``dataset`` in micro-batches; see :mod:`longboat.data`."""
        d = self.config.data
        # Tracked: checkpoints record its position, and a loaded one resumes it.
        loader = self.checkpointing.track(make_loader(
            dataset, rank=self.comm.rank, world_size=self.comm.world_size,
            micro_batch_size=self.batch.micro_batch_size,
            train_batch_size=self.batch.train_batch_size,
            shuffle=d.shuffle if shuffle is None else shuffle, seed=self.config.seed,
            remainder=d.remainder, num_workers=d.num_workers, collate_fn=collate_fn,
            announce=self.world.is_main, device=self.device,
        ))
        if self.monitor.breakdown is not None:
            loader.on_fetch = lambda: self.monitor.phase("data")
        return loader

    # -- state ---------------------------------------------------------------------------------

    def gathered_parameters(self) -> AbstractContextManager[None]:
        """A context inside which every parameter is whole on every rank, so that one rank may
        evaluate alone::

            with engine.gathered_parameters():      # every rank enters and leaves it
                if engine.comm.rank == 0:
                    with torch.no_grad():
                        engine.eval()(x)

        Only ZeRO-3 needs it (its parameters are sharded between forwards); under the other
        strategies a forward under ``torch.no_grad()`` or in ``eval()`` mode communicates nothing
        and can run on one rank anywhere. Read-only: parameter changes inside are not kept.
        """
        return self.strategy.gathered_parameters()

    def state_dict(self) -> dict[str, Any]:
        """The model's ``state_dict`` with the user's own keys and whole tensors."""
        return self.strategy.full_state_dict(self.model)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state)

    def save_checkpoint(self, directory: str | Path, tag: str | None = None,
                        client_state: Any = None) -> Path:
        """Save model, optimizer, scheduler, loader positions, RNG states and ``client_state``
        (JSON-able) under ``directory/tag`` (default tag: ``step-<global step>``), atomically.

        Every rank calls it with the same tag, right after ``step()`` returned True. The last
        ``checkpoint.keep_last`` checkpoints are kept (0: all). See :mod:`longboat.checkpoint`.
        """
        with self.monitor.phase("checkpoint"):
            return checkpoint.save(self, directory, tag, client_state)

    def load_checkpoint(self, directory: str | Path, tag: str | None = None, *,
                        allow_missing: bool = False) -> checkpoint.LoadedCheckpoint | None:
        """Load a checkpoint written by any strategy at any world size, after verifying its
        checksums and model fingerprint; every rank calls it.

        ``tag=None`` loads the latest. A missing checkpoint raises
        :class:`~longboat.checkpoint.CheckpointNotFoundError`, unless ``allow_missing`` (to resume
        if there is something to resume): then it returns None. Loaders created before or after
        this call continue where the saved ones stood.
        """
        with self.monitor.phase("checkpoint"):
            return checkpoint.load(self, directory, tag, allow_missing=allow_missing)

    def should_stop(self) -> bool:
        """True on every rank, at the same call, once any rank received SIGTERM or SIGINT
        (``longboat run`` being stopped, a scheduler preempting the job): save a checkpoint and
        leave the training loop. Call it at the same point on every rank, e.g. after each
        ``step()`` (it is one small all-reduce); the first call starts listening for the signals.
        """
        return self.checkpointing.stop.agreed(self.comm)

    def memory_report(self) -> MemoryReport:
        """Model-state bytes on this rank, counted from storages, beside the strategy's formula
        (see ``longboat.observe.memory``)."""
        a = self.trainable_params
        k = optimizer_state_bytes_per_param(self.optimizer)
        return MemoryReport(
            rank=self.comm.rank, strategy=self.strategy.name, trainable_params=a,
            world_size=self.comm.world_size,
            measured=measure(self.strategy.memory_tensors(self.optimizer)),
            expected=expected_bytes(self.strategy.name, a, self.comm.world_size, k))

    @property
    def device(self) -> torch.device:
        return device_for(self.world)

    def train(self, mode: bool = True) -> Engine:
        self.model.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def close(self) -> None:
        """Finish progress output, remove hooks and leave the process group if we joined it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self.monitor.close()
        self.strategy.close()
        self.checkpointing.stop.uninstall()
        commlog = self.comm.commlog
        if commlog is not None and self.world.is_main:
            # Rank 0's view; every rank's numbers are in engine.comm.log_summary().
            print(commlog.table(), end="", flush=True)
        self.comm.close()
        if self._owns_group:
            destroy_process_group()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
) -> Engine:
    """Make ``model`` train under the strategy the config asks for.

    The process group is joined if the environment describes one (``longboat run``, torchrun,
    Slurm, Open MPI) and none exists yet; plain ``python script.py`` is a world of one.
    ``optimizer`` and ``scheduler`` may come from the config's ``optimizer``/``scheduler``
    sections instead.
    """
    cfg = load_config(config)
    world = world or World.from_env()
    setup_logging(world, cfg.log.level)
    owns = init_process_group(world, timeout_s=cfg.comm.timeout_s)
    c = cfg.comm
    comm = Collectives(desync_check=c.desync_check, log=c.log, log_verbose=c.log_verbose,
                       timeout_s=c.timeout_s)
    if comm.world_size != world.world_size:
        raise RuntimeError(f"process group has {comm.world_size} ranks but the environment "
                           f"says {world.world_size}")
    if torch.cuda.is_available():
        model.to(device_for(world))
    if optimizer is None:
        if cfg.optimizer is None:
            raise ConfigError("no optimizer: pass one to longboat.initialize, or set the "
                              "config's 'optimizer' section, e.g. {type='AdamW', params={lr=1e-3}}")
        optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    if scheduler is None and cfg.scheduler is not None:
        scheduler = build_scheduler(optimizer, cfg.scheduler)
    return Engine(model, optimizer, cfg, world, comm, scheduler, owns_group=owns)
