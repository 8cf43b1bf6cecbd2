"""``longboat plan`` with pipeline stages: each stage's rank simulated through its schedule.

[Note: planning stages] A pipeline rank's memory depends on its schedule (how many micro-batches'
activations it holds at once) and its traffic on what its neighbours send, so the planner runs
the real :class:`~longboat.pipeline.runtime.Pipeline` on fake tensors, one stage's rank at a
time, with a :class:`PlannedLink` in place of the other ranks. Sends go through the meta
collectives (which count their bytes) and record the shape and dtype of what they carry;
a receive answers with an empty tensor of the shape the sending stage recorded. A gradient has
the shape of the activation it belongs to, which the receiving rank sent itself. An activation
comes from the stage before: the ranks are simulated in pipeline order, so with one stage per
rank it is always known; with virtual stages (interleaved) rank 0's stage ``p`` waits for the
last rank's stage ``p - 1``, so a rank that meets a message not yet recorded stops
(:class:`Unreached`) and runs again once the others have recorded theirs (at most ``v``
rounds). Every simulation builds its own engine, as a rank would.

[Note: stage activations] A stage's activations per micro-batch are the bytes its forward
action leaves live: from before its input arrives (the runtime keeps the received activation
until the backward) to the start of the rank's next action, when the forward's temporaries are
gone (on the last stage the logits, once the loss has been taken). A receive posted ahead
([Note: receives posted ahead]) allocates the next action's buffer within that window: it is
counted with the action it is received for, as if allocated when due (the peak counts it where
it is).
:meth:`PipelineSchedule.peak_held` then walks the rank's actions to find the most it holds at
once: ``m`` micro-batches' worth under GPipe,
at most ``p - r`` on rank ``r`` under 1F1B. The peak the planner reports is measured, not
derived: it is the live-tensor maximum of the simulated schedule ([Note: peak model]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from longboat.comm.protocol import Comm, Handle
from longboat.mesh import Mesh
from longboat.pipeline.p2p import Link, Message, Posted, Shape, Stream
from longboat.pipeline.runtime import Pipeline
from longboat.pipeline.schedule import split
from longboat.pipeline.schedules import PipelineSchedule
from longboat.plan.target import Target
from longboat.plan.tracker import LiveBytes

#: (micro-batch, stage) -> the shape and dtype of that stage's output for that micro-batch.
Shapes = dict[tuple[int, int], tuple[torch.Size, torch.dtype]]

T = TypeVar("T")


class Unreached(Exception):
    """A stage's rank needs a message whose shape no simulated rank has recorded yet."""


class PlannedLink(Link):
    """The other pipeline ranks, for one simulated rank ([Note: planning stages])."""

    # A stream of activations settles on its first shape, so the second simulated step sends
    # and holds what every later step of a real run does ([Note: shapes on the wire]).
    settle = 1

    def __init__(self, data: Comm, control: Comm, shapes: Shapes, probe: _Probe) -> None:
        super().__init__(data, control, torch.device("cpu"))
        self.shapes = shapes
        self.probe = probe

    def send(self, tensor: torch.Tensor, dst: int, message: Message) -> list[Handle]:
        self.shapes[(message.micro_batch, message.boundary)] = (tensor.shape, tensor.dtype)
        return super().send(tensor, dst, message)  # the meta collectives count the bytes

    def recv(self, src: int, message: Message, like: torch.Tensor | None = None) -> torch.Tensor:
        if (message.micro_batch, message.boundary) not in self.shapes:
            raise Unreached(message.receiving())
        # A received activation is its forward's from before it arrived: a buffer posted ahead
        # ([Note: receives posted ahead]) is the activation's, not what was live before it.
        p = self.posted
        ahead = p.buffer if p is not None and p.message == message and p.at is not None else None
        self.probe.arriving(ahead)
        return super().recv(src, message, like)  # the meta data plane receives nothing

    def post(self, src: int, message: Message, like: torch.Tensor | None = None) -> bool:
        if not super().post(src, message, like):
            return False
        assert self.posted is not None
        self.probe.posted(self.posted.buffer)
        return True

    def _known(self, message: Message) -> Shape:
        shape, dtype = self.shapes[(message.micro_batch, message.boundary)]
        return tuple(shape), dtype

    def _header_of(self, posted: Posted) -> Shape:
        return self._known(posted.message)  # fake bytes: the sender recorded the shape

    def _with_header(self, src: int, message: Message) -> torch.Tensor:
        shape = self._known(message)
        self.received.setdefault(message.boundary, Stream(self.settle)).seen(shape)
        return self._payload(src, message, shape)

    def share_losses(self, losses: list[torch.Tensor], m: int, src: int) -> list[float]:
        return [0.0] * m  # fake tensors have no values to share


class _Probe:
    """The engine's forward and backward, as the schedule drives them, and what each stage's
    forward action leaves live ([Note: stage activations]): from before its input arrives to
    the start of the rank's next action, when the forward's temporaries are gone."""

    def __init__(self, engine: Any, tracker: LiveBytes) -> None:
        self.engine, self.tracker = engine, tracker
        self.size: dict[int, int] = {}
        self._open: tuple[int, int] | None = None  # (stage, live before) of the last forward
        self._ahead = 0  # bytes of receives posted ahead since that forward began
        self._arrival: int | None = None  # live before the latest receive

    def mark(self) -> None:
        """An action begins (or the step ends): close the forward before it."""
        if self._open is not None:
            stage, before = self._open
            made = self.tracker.live - before - self._ahead
            self.size[stage] = max(self.size.get(stage, 0), made)
            self._open = None
            self._ahead = 0

    def posted(self, buffer: torch.Tensor) -> None:
        """A receive posted ahead allocated ``buffer`` (the next receiving action's) since
        the open forward's input arrived or it began: not that forward's."""
        if self._open is not None or self._arrival is not None:
            self._ahead += buffer.untyped_storage().nbytes()  # as the tracker counts it

    def arriving(self, buffer: torch.Tensor | None = None) -> None:
        """A receive is due; ``buffer``: the activation's, posted ahead (already live)."""
        self.mark()
        self._ahead = 0
        held = buffer.untyped_storage().nbytes() if buffer is not None else 0
        self._arrival = self.tracker.live - held

    def forward(self, *args: Any, stage: int) -> Any:
        self.mark()
        arrival = self._arrival if stage > 0 else None
        if arrival is None:
            self._ahead = 0  # the window starts now: nothing was posted within it yet
        before = arrival if arrival is not None else self.tracker.live
        self._arrival = None
        self._open = (stage, before)
        return self.engine.forward(*args, stage=stage)

    def backward(self, loss: torch.Tensor) -> None:
        self.mark()
        self._arrival = None
        self.engine.backward(loss)

    def backward_from(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        self.mark()
        self._arrival = None
        self.engine.backward_from(output, grad)

    def scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.mark()
        self._arrival = None
        return cast(torch.Tensor, self.engine.scaled_loss(loss))

    def backward_with(self, run: Callable[[], None]) -> None:
        self.mark()
        self._arrival = None
        self.engine.backward_with(run)


class StageSteps:
    """This rank's schedule, one optimizer step (``batch.gradient_accumulation_steps``
    micro-batches) per :meth:`step`, as ``engine.train_step`` runs it; then what it kept."""

    def __init__(
        self,
        engine: Any,
        target: Target,
        model: torch.nn.Module,
        micro_batch: int,
        tracker: LiveBytes,
        shapes: Shapes,
    ) -> None:
        pipe = engine.schedule
        if not isinstance(pipe, Pipeline):
            raise TypeError(f"expected a pipeline schedule with mesh.pp > 1, got {type(pipe)}")
        self.engine, self.target, self.model, self.micro_batch = engine, target, model, micro_batch
        self.pipe = pipe
        self.probe = _Probe(engine, tracker)
        pipe.link = PlannedLink(pipe.data, pipe.control, shapes, self.probe)

    def step(self) -> None:
        m = self.engine.accumulation_steps
        batch = self.target.example_input(self.model, self.micro_batch * m)
        micro_batches = split(batch, self.micro_batch, m)
        self.pipe.run(self.probe, micro_batches, self.target.loss, inputs=tuple)
        self.probe.mark()
        self.engine.step()

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(self._schedule().stages_of(self.pipe.rank))

    @property
    def activations(self) -> int:
        """The most the schedule holds at once ([Note: stage activations])."""
        size = self.probe.size
        return self._schedule().peak_held(self.pipe.rank, lambda s: size.get(s, 0))

    @property
    def in_flight(self) -> int:
        """The most micro-batches held at once."""
        return self._schedule().peak_held(self.pipe.rank, lambda _s: 1)

    def _schedule(self) -> PipelineSchedule:
        return self.pipe.plan(self.engine.accumulation_steps)


def each_stage(mesh: Mesh, simulate_rank: Callable[[int, Shapes], T]) -> list[T]:
    """``simulate_rank(global rank, shapes)`` for the first data-parallel rank of every
    pipeline rank, in pipeline order, with the shapes they send shared
    ([Note: planning stages])."""
    shapes: Shapes = {}
    ranks = [mesh.rank_of(pp=r) for r in range(mesh.pp)]
    done: dict[int, T] = {}
    waiting = ""
    for _ in range(mesh.pp * mesh.pp + 1):  # each round records at least one new stage
        for rank in ranks:
            if rank in done:
                continue
            try:
                done[rank] = simulate_rank(rank, shapes)
            except Unreached as e:
                waiting = str(e)
        if len(done) == len(ranks):
            return [done[r] for r in ranks]
    raise RuntimeError(f"planning the pipeline stages: no rank sends the {waiting}")
