"""DeepSpeed's engine object on longboat's :class:`~longboat.engine.Engine`: the methods and
properties a DeepSpeed training loop calls, with DeepSpeed's meanings ([Note: DeepSpeed call
sites] in ``deepspeed/__init__.py``)."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from longboat.config.errors import ConfigError
from longboat.pipeline.schedule import default_inputs

if TYPE_CHECKING:
    from longboat.engine import Engine


# The engines deepspeed.initialize made that are still alive: DeepSpeed's
# zero.GatheredParameters(params) names parameters only, and the engine sharding them is found
# here ([Note: DeepSpeed zero contexts] in deepspeed/zero.py). Weak, so an engine dropped by the
# script is not kept alive by it.
_LIVE: weakref.WeakSet[DeepSpeedEngine] = weakref.WeakSet()


def live_engines() -> list[DeepSpeedEngine]:
    """The engines made by ``deepspeed.initialize`` that are alive and not destroyed."""
    return list(_LIVE)


def _repeating(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's batches epoch after epoch (DeepSpeed's ``RepeatingLoader``)."""
    while True:
        yield from loader


class DeepSpeedEngine:
    """A longboat :class:`~longboat.engine.Engine` behind DeepSpeed's engine methods."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.training_dataloader: Any = None  # set by initialize() from training_data
        # what train_batch() reads: set_dataiterator's, or its own over that loader
        self._data_iter: Iterator[Any] | None = None
        self._applied = True  # whether the last optimizer step was applied
        self._no_sync = False  # inside no_sync()
        _LIVE.add(self)

    # -- training ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        if not self._no_sync:
            self.engine.backward(loss)
            return
        # [Note: DeepSpeed no_sync] Inside no_sync(), a backward adds this rank's gradients to
        # what it holds and reduces nothing, and is not a micro-step (DeepSpeed: "tracking of
        # gradient accumulation steps is disabled"): the strategy is told, as for a micro-batch
        # before the accumulation boundary, not to synchronise; the next backward outside the
        # context reduces the sum. The loss is divided by the accumulation, as every backward's.
        e = self.engine
        e.strategy.before_backward(sync=False)
        scaled = e.precision.scale(loss / e.accumulation_steps)
        scaled.backward()  # type: ignore[no-untyped-call]
        e.strategy.after_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's ``no_sync()``: backwards inside accumulate this rank's gradients without
        reducing them (see [Note: DeepSpeed no_sync]); ``step()`` inside, entering it twice, and
        ZeRO stages 2-3 (whose gradients are partitioned as they are reduced) are refused, as in
        DeepSpeed."""
        stage = self.zero_optimization_stage()
        if stage >= 2:
            raise ConfigError(
                f"no_sync() is incompatible with ZeRO stage {stage}, which partitions gradients "
                "as it reduces them (as in DeepSpeed); use gradient_accumulation_steps instead"
            )
        if self._no_sync:
            raise ConfigError("no_sync() entered again inside no_sync(): not supported")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def step(self) -> None:
        """The optimizer step at an accumulation boundary; between boundaries nothing (as
        DeepSpeed's ``step()``, called after every micro-batch)."""
        if self._no_sync:
            raise ConfigError(
                "step() inside no_sync(): leave the context first (as DeepSpeed requires); the "
                "backward after it reduces the gradients accumulated inside"
            )
        skipped = self.engine.skipped_steps
        if self.engine.step():
            self._applied = self.engine.skipped_steps == skipped

    def train_batch(
        self, data_iter: Iterator[Any] | None = None, loss_fn: Callable[..., Any] | None = None
    ) -> torch.Tensor:
        """One optimizer step on ``gradient_accumulation_steps()`` micro-batches, each an
        ``(inputs, labels)`` pair, the loss ``loss_fn(outputs, labels)`` (default: the module's
        ``loss_fn``, as DeepSpeed's ``PipelineModule`` has); returns the mean loss, averaged
        over the data-parallel ranks, on every rank (DeepSpeed's pipeline engine's
        ``agg_train_loss``). Runs through the pipeline schedule when ``mesh.pp > 1``.

        As DeepSpeed's pipeline engine: ``data_iter`` is kept for later calls
        (:meth:`set_dataiterator`), else the ``training_data`` given to :func:`initialize` is
        read, repeating; a stage that is neither the first nor the last reads no data, so it
        may pass none and draws nothing from one it is given. The module is put in training
        mode first (``eval_batch`` leaves it in eval mode)."""
        loss_fn = loss_fn or getattr(self.module, "loss_fn", None)
        if loss_fn is None:
            raise ConfigError(
                "train_batch() needs a loss: give loss_fn=..., or set the module's loss_fn "
                "attribute (DeepSpeed's PipelineModule(loss_fn=...))"
            )
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        batch = None  # a middle pipeline stage's: it reads no data
        if self.engine.schedule.reads_data:
            count = self.gradient_accumulation_steps()
            micro = list(itertools.islice(self._source(), count))
            if len(micro) < count:
                raise StopIteration("data_iter ran out within a step")
            batch = tuple(torch.cat(parts) for parts in zip(*micro, strict=True))
        self.engine.train()
        mean = self.engine.train_step(batch, lambda out, mb: loss_fn(out, mb[1]))
        total = self.engine.reduce_metrics({"loss": mean})["loss"]
        return torch.tensor(total / self.engine.topology.mesh.dp)

    def _source(self) -> Iterator[Any]:
        if self._data_iter is None:
            if self.training_dataloader is None:
                raise ConfigError(
                    "train_batch() without data_iter needs training_data given to "
                    "initialize(), or an iterator given earlier (train_batch(data_iter) or "
                    "set_dataiterator)"
                )
            self._data_iter = iter(_repeating(self.training_dataloader))
        return self._data_iter

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator :meth:`train_batch` reads from from now on, on the first and last
        pipeline stages (the others read no data), as DeepSpeed's."""
        if self.engine.schedule.reads_data:
            self.training_dataloader = None
            self._data_iter = iterator

    # -- the pipeline's stages, as DeepSpeed's pipeline engine names them ----------------------

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.engine.schedule.held_stages[0]

    @property
    def num_stages(self) -> int:
        return self.engine.schedule.stages

    def is_first_stage(self) -> bool:
        return 0 in self.engine.schedule.held_stages

    def is_last_stage(self) -> bool:
        return self.num_stages - 1 in self.engine.schedule.held_stages

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> torch.Tensor:
        """DeepSpeed's pipeline ``eval_batch``: the module in eval mode without gradients on
        ``num_micro_batches`` (default ``gradient_accumulation_steps()``) ``(inputs, labels)``
        micro-batches from ``data_iter``, through the pipeline's stages when ``mesh.pp > 1``;
        returns the loss (the module's ``loss_fn``) averaged over them and over the
        data-parallel ranks, on every rank, as DeepSpeed's ``reduce_output='avg'`` with
        ``bcast_loss`` does. The module is left in eval mode, as DeepSpeed leaves it
        (``train_batch`` puts it back in training mode). ``return_logits``,
        ``compute_loss=False`` and another ``reduce_output`` are refused by name."""
        del bcast_loss  # the losses are on every rank of the pipeline here
        for name, bad in (
            ("return_logits=True", return_logits),
            ("compute_loss=False", not compute_loss),
            (f"reduce_output={reduce_output!r}", reduce_output != "avg"),
        ):
            if bad:
                raise ConfigError(
                    f"eval_batch({name}) is not supported: it returns the average loss; leave "
                    "it at its default"
                )
        loss_fn = getattr(self.module, "loss_fn", None)
        if loss_fn is None:
            raise ConfigError(
                "eval_batch() needs the module's loss_fn (DeepSpeed's PipelineModule(loss_fn=...))"
            )
        count = num_micro_batches or self.gradient_accumulation_steps()
        micro = list(itertools.islice(data_iter, count))
        if len(micro) < count:
            raise StopIteration("data_iter ran out within eval_batch")
        self.engine.eval()
        with torch.no_grad():
            losses = self.engine.schedule.evaluate(
                self.engine, micro, lambda out, mb: loss_fn(out, mb[1]), default_inputs
            )
        mean = sum(losses) / len(losses)
        total = self.engine.reduce_metrics({"loss": mean})["loss"]
        return torch.tensor(total / self.engine.topology.mesh.dp)

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

    def get_global_grad_norm(self) -> float | None:
        """The norm of all gradients (over every rank's shard) at the last optimizer step, or
        None before the first one and where none is computed: longboat computes it when it
        clips (``gradient_clipping`` above 0, DeepSpeed's default 1.0). DeepSpeed's answer at
        ZeRO stage 0 without fp16 is None even when it clips; here it is the norm."""
        norm = self.engine.last_grad_norm
        return None if norm is None else float(norm)

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
        _LIVE.discard(self)
        self.engine.close()
