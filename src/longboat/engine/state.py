"""What the engine does between steps: evaluation, whole state dicts, checkpoints, the stop
vote and the memory report. The engine inherits these (``longboat.engine.core.Engine``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset

from longboat import checkpoint
from longboat.checkpoint.layout import default_tag
from longboat.checkpoint.protocol import Trained
from longboat.evaluation import EvalLoader, reduce_metrics
from longboat.observe.memory import (
    MemoryReport,
    measure,
    optimizer_state_bytes_per_param,
)
from longboat.observe.monitor import Monitor
from longboat.strategies.base import Strategy
from longboat.world import World


class _Engine(Trained, Protocol):
    """What these methods use of the engine, besides what a checkpoint does."""

    strategy: Strategy
    monitor: Monitor
    world: World
    trainable_params: int

    @property
    def device(self) -> torch.device: ...


class StateMethods:
    """The engine's methods between steps; every rank calls each of them."""

    def eval_loader(
        self: _Engine,
        dataset: Dataset[Any],
        *,
        batch_size: int | None = None,
        collate_fn: Callable[..., Any] | None = None,
    ) -> EvalLoader:
        """This rank's disjoint share of ``dataset`` for evaluation, in order, every sample on
        exactly one data-parallel rank and every rank yielding as many batches (a rank whose
        share ended gets empty ones); sum metrics over the ranks with :meth:`reduce_metrics`.
        ``batch_size`` defaults to the micro-batch size. See [Note: exact evaluation] in
        ``longboat/evaluation.py``."""
        return EvalLoader(
            dataset,
            self.topology.coords["dp"],
            self.topology.mesh.dp,
            batch_size or self.batch.micro_batch_size,
            collate_fn,
            None if self.device.type == "cpu" else self.device,
        )

    def reduce_metrics(
        self: _Engine, values: Mapping[str, float | torch.Tensor]
    ) -> dict[str, float]:
        """``values`` (sums: correct answers, summed losses, counts) summed over the
        data-parallel ranks, the same on every rank; every rank calls it."""
        return reduce_metrics(values, self.topology.control("dp"))

    def gathered_parameters(self: _Engine) -> AbstractContextManager[None]:
        """A context inside which every parameter is whole on every rank, so that one rank may
        evaluate alone::

            with engine.gathered_parameters():      # every rank enters and leaves it
                if engine.world.rank == 0:
                    with torch.no_grad():
                        engine.eval()(x)

        Only ZeRO-3 needs it (its parameters are sharded between forwards); under the other
        strategies a forward under ``torch.no_grad()`` or in ``eval()`` mode communicates nothing
        and can run on one rank anywhere. Read-only: parameter changes inside are not kept.
        """
        return self.strategy.gathered_parameters()

    def state_dict(self: _Engine) -> dict[str, Any]:
        """The model's ``state_dict`` with the user's own keys and whole tensors."""
        return self.strategy.full_state_dict(self.model)

    def load_state_dict(self: _Engine, state: Mapping[str, Any]) -> None:
        """Load whole tensors (as :meth:`state_dict` gives them, every key) into the model,
        whatever the layout: each rank keeps its share (ZeRO-3 its shards, tensor parallelism
        its slices). The optimizer state stays as it was. Every rank calls it, between steps."""
        current = self.strategy.checkpoint_state(self.model, self.optimizer)
        source = checkpoint.StateDictSource(state, current)
        self.strategy.load_checkpoint_state(self.model, self.optimizer, source)

    def save_checkpoint(
        self: _Engine, directory: str | Path, tag: str | None = None, client_state: Any = None
    ) -> Path:
        """Save model, optimizer, scheduler, loader positions, RNG states and ``client_state``
        (JSON-able) under ``directory/tag`` (default tag: ``step-<global step>``), atomically.

        Every rank calls it with the same tag, right after ``step()`` returned True. The last
        ``checkpoint.keep_last`` checkpoints are kept (0: all). See :mod:`longboat.checkpoint`.
        """
        if not self.strategy.writes_checkpoints:
            # A worker of an async or ssp parameter-server job: there is no collective between
            # workers, so worker 0 writes for all ([Note: parameter server roles]).
            return Path(directory) / (
                str(tag) if tag is not None else default_tag(self.global_step)
            )
        with self.monitor.phase("checkpoint"):
            return checkpoint.save(self, directory, tag, client_state)

    def load_checkpoint(
        self: _Engine, directory: str | Path, tag: str | None = None, *, allow_missing: bool = False
    ) -> checkpoint.LoadedCheckpoint | None:
        """Load a checkpoint written by any strategy at any world size, after verifying its
        checksums and model fingerprint; every rank calls it.

        ``tag=None`` loads the latest. A missing checkpoint raises
        :class:`~longboat.checkpoint.CheckpointNotFoundError`, unless ``allow_missing`` (to resume
        if there is something to resume): then it returns None. Loaders created before or after
        this call continue where the saved ones stood.
        """
        with self.monitor.phase("checkpoint"):
            return checkpoint.load(self, directory, tag, allow_missing=allow_missing)

    def set_total_steps(self: _Engine, total: int) -> None:
        """Tell the console how many optimizer steps the run takes (for its ETA)."""
        self.monitor.set_total_steps(total)

    def should_stop(self: _Engine) -> bool:
        """True on every rank, at the same call, once any rank received SIGTERM or SIGINT
        (``longboat run`` being stopped, a scheduler preempting the job): save a checkpoint and
        leave the training loop. Call it at the same point on every rank, e.g. after each
        ``step()`` (it is one small all-reduce); the first call starts listening for the signals.
        """
        return self.checkpointing.stop.agreed(self.control)

    def memory_report(self: _Engine) -> MemoryReport:
        """Model-state bytes on this rank, counted from storages, beside the strategy's formula
        (see ``longboat.observe.memory``)."""
        a = self.trainable_params
        k = optimizer_state_bytes_per_param(self.optimizer)
        n = self.topology.mesh.dp_shard
        formula = self.strategy.expected_memory(a, k)  # each strategy owns its formula
        return MemoryReport(
            rank=self.world.rank,
            strategy=self.strategy.name,
            trainable_params=a,
            world_size=n,
            measured=measure(self.strategy.memory_tensors(self.optimizer)),
            expected=formula,
            on_disk=dict(self.strategy.on_disk),
            on_host=dict(self.strategy.on_host),
        )
