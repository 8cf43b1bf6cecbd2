"""The training step: forward, backward, accumulation boundary, clipping, optimizer, scheduler.

Everything that depends on how state is distributed belongs to the strategy; the engine only
sequences the step.
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from longboat import checkpoint, placement
from longboat.checkpoint.exchange import gather_json
from longboat.comm.errors import CollectiveTimeout, PeerLost
from longboat.compile import Compiler
from longboat.config.batch import ResolvedBatch, resolve_batch
from longboat.config.compositions import refuse_built
from longboat.config.errors import ConfigError
from longboat.config.sections import Config
from longboat.data import Loader, build_loader
from longboat.engine.closing import Closing, leave_if_alive
from longboat.engine.recovering import Recovering
from longboat.engine.split import SplitBackwardMethods
from longboat.engine.state import StateMethods
from longboat.grads import clip_by_global_norm_
from longboat.join import JoinVote, Turn
from longboat.observe.monitor import Monitor
from longboat.optim.checks import check_parameters, facts_of
from longboat.optim.self_reducing import check_bound
from longboat.pipeline.schedule import LossFn, Schedule, Sequential, default_inputs, steps_of
from longboat.precision import Precision, SkippedStep
from longboat.recovery.injob import in_job
from longboat.strategies.base import cannot_shadow
from longboat.strategies.registry import build_strategy
from longboat.tensor import TensorParallel
from longboat.tensor.strategy import wrap as tensor_parallel_over
from longboat.topology import Topology
from longboat.world import World, device_for

T = TypeVar("T")


class Engine(StateMethods, SplitBackwardMethods, Recovering, Closing):
    """A model trained by a strategy. Create it with :func:`longboat.initialize`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config,
        world: World,
        topology: Topology,
        scheduler: LRScheduler | None = None,
        owns_group: bool = False,
        schedule: Schedule | None = None,
        tensor: TensorParallel | None = None,
        service: Any = None,
        param_init_fn: Callable[[nn.Module], object] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.world = world
        self.topology = topology
        mesh = topology.mesh
        # The data-parallel axis: the batch arithmetic and the loader count its ranks; its data
        # plane carries the gradients. Agreements of the whole job (overflow skips, checkpoint
        # exchanges, monitor events, stop votes) go over the world's control plane.
        self.comm = topology.data("dp")
        self.control = topology.control("world")
        self.model = model  # the user's module, parameter names unchanged
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.batch: ResolvedBatch = resolve_batch(config.batch, mesh.dp)
        # How a step's micro-batches run: in turn, or through pipeline stages (then ``model``
        # is already this rank's stages, see initialize()).
        self.schedule: Schedule = schedule or Sequential()
        self.schedule.check(self.batch.gradient_accumulation_steps)
        # Backwards per optimizer step on this rank: one per micro-batch and stage held.
        self._backwards = self.batch.gradient_accumulation_steps * self.schedule.stages_per_rank
        check_parameters(model, optimizer)
        # Counted before the strategy may shard the parameters away (this rank's slices of
        # the layers tensor parallelism divided).
        self.trainable_params = sum(
            p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad
        )
        # Layers divided across the tp ranks (see initialize()); with tp = 1, nothing.
        self.tensor = tensor or TensorParallel(config.tensor_parallel, topology.data("tp"))
        # Names, full shapes and dtypes (the model fingerprint), also before any sharding.
        self.checkpointing = checkpoint.Checkpointing(
            model, topology.control("pp"), self.tensor.full_shapes()
        )
        self.strategy = tensor_parallel_over(
            build_strategy(
                config.resolved_strategy(mesh.dp),
                world,
                topology,
                config,
                isolated=frozenset(id(p) for p in self.schedule.ties.parameters()),
                service=service,
                param_init_fn=param_init_fn,
                device=(device := device or device_for(world)),
            ),
            self.tensor,
            topology.rank,
        )
        placed = self.strategy.places_parameters
        placement.to_device(model, device, keep_parameters=placed)
        # What does not combine with this model and optimizer ([Note: compositions]).
        first = next(model.parameters(), None)
        on = device.type if placed or first is None or first.is_meta else first.device.type
        meta = any(p.is_meta for p in model.parameters())
        strategy, deferred = config.resolved_strategy(mesh.dp), self.strategy.deferred_init
        facts = facts_of(optimizer, strategy=strategy, device=on, meta=meta, deferred_init=deferred)
        try:
            refuse_built(config, facts)
            self.module = self.strategy.setup(model, optimizer)
            check_bound(optimizer, self.strategy.name)
        except BaseException:
            self.strategy.discard()  # a parameter server's worker stops its heartbeats
            raise
        self.precision = Precision(config.precision, device_for(world))
        # Gradients a strategy keeps out of memory ([Note: parameter offload]).
        self._held = self.strategy.held_gradients()
        self.micro_step = 0
        self._begun = 0  # micro_step at the current step's first backward
        self.global_step = 0  # optimizer steps taken or skipped (as DeepSpeed's global_steps)
        self.skipped_steps = 0  # fp16 steps skipped for a gradient overflow
        self.last_grad_norm: torch.Tensor | None = None
        # [Note: the loss stays on the device]: a tensor once a backward has added to it
        self._loss_sum: torch.Tensor | float = 0.0
        self._loss_count = 0
        self._last_loss: torch.Tensor | float | None = None
        self._owns_group = owns_group
        self._closed = False
        # [Note: compiling under a strategy] in compile.py: set by assemble()
        self.compiler: Compiler | None = None
        self.log = logging.getLogger("longboat")
        self.monitor = Monitor(
            config,
            self.control,
            topology,
            is_main=world.is_main,
            train_batch_size=self.batch.train_batch_size,
            optimizer=optimizer,
            device=device_for(world),
            loss_scale=lambda: (
                self.precision.loss_scale if self.precision.checks_overflow else None
            ),
            # What a strategy reports besides (parameter servers: per-worker staleness).
            extra=self.strategy.monitor_values,
            extra_columns=tuple(self.strategy.monitor_columns),
        )
        layout = "" if mesh.dp == mesh.world_size else f" (mesh {mesh.describe()})"
        self.log.info(
            "strategy %s on %d rank(s)%s; batch: %d per step = micro %d x accumulation "
            "%d x data-parallel %d",
            self.strategy.name,
            mesh.world_size,
            layout,
            self.batch.train_batch_size,
            self.batch.micro_batch_size,
            self.batch.gradient_accumulation_steps,
            mesh.dp,
        )
        if self.precision.describe():
            self.log.info("precision %s", self.precision.describe())
        # [Note: joining] in join.py: ranks may run out of batches at different times.
        self._join: JoinVote | None = None
        self._turn: Turn | None = None  # the current micro-batch's vote, while joining
        if config.data.remainder == "join":
            if not self.strategy.can_shadow:
                raise cannot_shadow(self.strategy.name)
            self._join = JoinVote(topology.control("dp"), self.accumulation_steps)
            self.log.info(
                "uneven inputs: data.remainder='join': a rank that runs out of batches first "
                "shadows the others' collectives with zero contributions until all are done; "
                "each micro-batch's gradient is averaged over the ranks that had one"
            )
        self._recovery = in_job(config, world, self.strategy, model, topology)
        # Leave the process group at exit even if the script never calls close(); a weak
        # reference so that an engine dropped early is not kept alive by the registry.
        self._atexit: Callable[[], None] = functools.partial(leave_if_alive, weakref.ref(self))
        atexit.register(self._atexit)

    # -- the step ------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through the model (under autocast unless fp32; floating outputs in fp32)."""
        self.monitor.forward_begin(self.global_step, args, kwargs)
        with self.monitor.phase("forward"):
            self.strategy.before_forward()
            with self.precision.autocast():
                try:
                    out = self.module(*args, **kwargs)
                except (CollectiveTimeout, PeerLost) as e:  # ZeRO-3's gathers
                    raise self._lost_in_forward(e) from None
        return self.precision.cast_output(out)

    forward = __call__

    @property
    def accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    @property
    def is_boundary(self) -> bool:
        """True when the next :meth:`backward` completes an optimizer step's gradients."""
        return (self.micro_step + 1) % self._backwards == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled for accumulation, and by the fp16 loss scale);
        synchronises at the boundary."""
        share = self._share()
        # torch's Tensor.backward is unannotated
        self._backward(lambda: self.precision.scale(loss / share).backward())  # type: ignore[no-untyped-call]
        # [Note: the loss stays on the device]
        self._loss_sum = self._loss_sum + loss.detach().float()
        self._loss_count += 1

    def backward_from(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward from ``output``'s gradient ``grad`` (already divided by the accumulation
        and loss-scaled by the stage after): a pipeline stage before the last."""
        self._backward(lambda: torch.autograd.backward(output, grad))

    def _share(self) -> float:
        """What this micro-batch's loss is divided by: the accumulation; while ranks have
        joined, so that the strategies' average over every rank is the average over those with
        a batch ([Note: joining])."""
        turn, self._turn = self._turn, None
        dp = self.topology.mesh.dp
        if turn is None or turn.count == dp:
            return self.accumulation_steps
        return self.accumulation_steps * turn.count / dp

    def _backward(self, run: Callable[[], None]) -> None:
        if self._redo:  # the rest of a step a regroup interrupted: see _carry_on
            return
        if self.micro_step % self._backwards == 0:
            self._begun = self.micro_step
        try:
            with self.monitor.phase("backward"):
                self.strategy.before_backward(sync=self.is_boundary)
                run()
                self.strategy.after_backward()
        except (CollectiveTimeout, PeerLost) as e:
            if not self._carry_on(e, rest_of_step=True):
                raise
            return  # regrouped: the step is redone from its first micro-batch
        self.micro_step += 1

    def step(self) -> bool:
        """At the accumulation boundary: unscale, check (fp16), clip, step, zero grads, scheduler.

        Between boundaries it does nothing and returns False, so it can be called after every
        micro-batch, as with DeepSpeed. At a boundary it returns True, also when an fp16
        overflow made every rank skip the step: then no parameter, optimizer state or scheduler
        moves, ``skipped_steps`` grows and ``global_step`` still counts it (as in DeepSpeed).
        """
        if self._redone() or self.micro_step == self._begun or self.micro_step % self._backwards:
            return False
        try:
            with self.monitor.phase("optimizer"):
                self._optimizer_step()
        except (CollectiveTimeout, PeerLost) as e:
            if not self._carry_on(e):
                raise
            return False  # regrouped: the step is redone from its first micro-batch
        self.global_step += 1
        self._stepped()
        loss = self._loss_sum / self._loss_count if self._loss_count else None
        self._loss_sum, self._loss_count = 0.0, 0
        self._last_loss = loss
        self.monitor.step_end(self.global_step, loss)
        return True

    @property
    def last_loss(self) -> float | None:
        """The mean loss of the last step's micro-batches on this rank (None before the first);
        the first read waits for the device ([Note: the loss stays on the device])."""
        if isinstance(self._last_loss, torch.Tensor):
            self._last_loss = float(self._last_loss)
        return self._last_loss

    # Note [the loss stays on the device]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # backward() adds each loss to a device tensor: a float() after backward made the host wait
    # for it before launching the optimizer step, and the GPU idled while the host launched
    # the step's kernels (1.6 ms of a 44 ms step on an H200, docs/gpu.md). It is read when
    # asked for: last_loss, the monitor when an event is due, the step budget.

    def _optimizer_step(self) -> None:
        self.strategy.finish_gradients()
        skip = False
        ties = self.schedule.ties
        if ties.parameters():  # [Note: tied weights] in pipeline/tied.py: holders sum gradients
            self.strategy.wait_gradients()
            ties.reduce(self.strategy.tied_gradient)
        if self.precision.checks_overflow or self.config.gradient_clipping > 0:
            # Both need every gradient; without them the strategy may overlap the optimizer
            # with the communication still in flight.
            self.strategy.wait_gradients()
            grads = self.strategy.local_gradients()
            skip = self.precision.unscale_and_check(grads, self.control)  # same everywhere
            self.precision.update(skip, self.global_step + 1)
            if self.config.gradient_clipping > 0 and not skip:
                self.last_grad_norm = clip_by_global_norm_(
                    grads,
                    self.config.gradient_clipping,
                    self.strategy.norm_groups() + self.schedule.norm_groups(),
                    self.device,
                    not_counted=ties.counted_elsewhere(self.strategy.tied_gradient)
                    + self.tensor.counted_elsewhere(self.strategy),
                    held=self._held,
                )
        # A skipped step still runs the strategy's step bookkeeping ([Note: skipped step]).
        # SkippedStep stands in for the optimizer, passing every other attribute through.
        skipped = cast(torch.optim.Optimizer, SkippedStep(self.optimizer))
        self.strategy.optimizer_step(skipped if skip else self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += skip
        if self.scheduler is not None and not skip:
            self.scheduler.step()

    def train_step(
        self, batch: Any, loss_fn: LossFn, *, inputs: Callable[[Any], tuple[Any, ...]] | None = None
    ) -> float:
        """One optimizer step on ``batch``, this rank's samples of the step (accumulation x
        micro-batch of them, in dim 0 of a tensor or of each tensor in a tuple, list or dict;
        ``engine.loader(dataset, per_step=True)`` yields such batches).

        The batch is split into micro-batches that the schedule runs forward (the model called
        on ``inputs(micro_batch)``, by default the first element of a tuple) and backward
        (``loss_fn(output, micro_batch)``), then :meth:`step` runs. Returns the mean loss of
        the micro-batches on this rank. ``batch`` is None on a pipeline rank that holds
        neither the first stage nor the last (``schedule.reads_data`` is False).
        """
        if self.micro_step % self._backwards:
            raise RuntimeError(
                "train_step() in the middle of an accumulation begun with "
                "backward(): finish it with step() first"
            )
        if self._join is not None:
            raise ConfigError(
                "engine.train_step with data.remainder = 'join': join shadows the micro-batch "
                "loop (engine(x), backward, step) one micro-batch at a time; iterate "
                "micro-batches, or use data.remainder = 'pad'"
            )
        n, size = self.accumulation_steps, self.batch.micro_batch_size
        micro_batches = steps_of(self.schedule, batch, size, n)
        losses = self.schedule.run(self, micro_batches, loss_fn, inputs or default_inputs)
        # The step's losses as the schedule reports them (a pipeline's come from its last
        # stage, shared with every stage).
        self._loss_sum, self._loss_count = sum(losses), len(losses)
        self.step()
        return sum(losses) / len(losses)

    # -- data ----------------------------------------------------------------------------------

    def loader(
        self,
        dataset: Dataset[Any] | DataLoader[Any],
        *,
        shuffle: bool | None = None,
        collate_fn: Callable[..., Any] | None = None,
        per_step: bool = False,
    ) -> Loader:
        """This rank's shard of ``dataset`` in micro-batches (``per_step``: in batches of a
        whole optimizer step, for :meth:`train_step`); see :mod:`longboat.data`.

        ``dataset`` may be a map-style data set (permuted by seed and epoch, [Note: shards]), a
        stream, a ``torch.utils.data.IterableDataset`` (sample ``i`` to data-parallel rank
        ``i % n`` in the stream's own order, ``set_epoch`` called each epoch, no ``len()``;
        ``shuffle=True`` refused; [Note: streams]), or a ``DataLoader`` built with a
        ``DistributedSampler`` whose ``num_replicas`` and ``rank`` are the data-parallel
        mesh's, used as it is ([Note: your DataLoader]; one without is refused). Resuming a
        checkpoint continues the epoch where it stood (a stream reads the epoch's consumed
        samples again and skips them).

        Under ``data.remainder = 'join'`` each iteration runs through :meth:`join`: ranks
        keep the samples of the epoch's last step that fall to them, and the loop ends on every
        rank together."""
        if per_step and self._join is not None:
            raise ConfigError(
                "engine.loader(per_step=True) with data.remainder = 'join': join shadows the "
                "micro-batch loop, not engine.train_step; iterate micro-batches (per_step=False), "
                "or use data.remainder = 'pad'"
            )
        per_batch = self.batch.micro_batch_size * (self.accumulation_steps if per_step else 1)
        # Tracked: checkpoints record its position, and a loaded one resumes it.
        loader = self.checkpointing.track(
            build_loader(
                dataset,
                rank=self.topology.coords["dp"],
                world_size=self.topology.mesh.dp,
                batch_size=per_batch,
                per_step=per_step,
                train_batch_size=self.batch.train_batch_size,
                data=self.config.data,
                shuffle=shuffle,
                seed=self.config.seed,
                collate_fn=collate_fn,
                announce=self.world.is_main,
                device=self.device,
                # A DataLoader's sampler may disagree with the mesh on some ranks only (built
                # with the global rank under tp or pp): every rank hears every rank's verdict,
                # so all refuse together rather than leave the others waiting.
                agree=lambda problem: gather_json(self.control, problem),
            )
        )
        if self._recovery is not None:
            self._recovery.track(loader)
        if self.monitor.breakdown is not None:
            loader.on_fetch = lambda: self.monitor.phase("data")
        if self._join is not None:
            loader.through = self._joined
        return loader

    def join(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches`` (this rank's micro-batches, as many as it has) for a training loop in
        which ranks may run out at different times, under ``data.remainder = 'join'``::

            for x, y in engine.join(my_loader):     # my_loader's length may differ by rank
                engine.backward(loss_fn(engine(x), y))
                engine.step()

        Before each micro-batch the data-parallel ranks vote on who has one; a rank that ran
        out shadows the others' collectives with zero contributions, and each micro-batch's
        gradient is the average over the ranks that had one. The loop ends on every rank when
        no rank has a batch (a step begun is finished first). ``engine.loader`` does this by
        itself under the policy. See [Note: joining] in ``longboat/join.py`` for what the loop
        body may do.
        """
        if self._join is None:
            raise ConfigError(
                "engine.join needs the join policy: set data.remainder = 'join' in the config"
            )
        if getattr(batches, "through", None) is not None:  # an engine.loader: it joins already
            return iter(batches)
        return self._joined(batches)

    def _joined(self, batches: Iterable[T]) -> Iterator[T]:
        """[Note: joining]: vote before each micro-batch; shadow once out; end together."""
        vote = self._join
        assert vote is not None
        vote.begin()
        a = self._backwards
        try:
            for batch in batches:
                self._take(vote.vote(True, self.global_step, self.micro_step % a))
                yield batch
            turn = vote.vote(False, self.global_step, self.micro_step % a)
            while turn.count:  # the others still have batches: shadow theirs
                self._take(turn)
                self._shadow()
                turn = vote.vote(False, self.global_step, self.micro_step % a)
            while self.micro_step % a:  # every rank ran out inside a step: finish it
                self._shadow()
        finally:
            self._turn = None
            self.strategy.buffers_from(0)

    def _take(self, turn: Turn) -> None:
        """The vote of the micro-batch about to run: how its loss is divided, whose buffers
        count after it."""
        self._turn = turn
        if turn.first is not None:
            self.strategy.buffers_from(turn.first)

    def _shadow(self) -> None:
        """A micro-batch this rank has no batch for: every collective the others' backward
        and step issue, with nothing of its own ([Note: joining])."""
        self._turn = None
        self._backward(self.strategy.shadow)
        self.step()

    @property
    def device(self) -> torch.device:
        return device_for(self.world)

    def train(self, mode: bool = True) -> Engine:
        self.model.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
