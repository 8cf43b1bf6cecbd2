"""Tensors between neighbouring stages, and the few bytes that say their shapes.

[Note: shapes on the wire] A receiver must allocate a tensor of the right shape and dtype
before it can receive one, and a stage's output shape may change with the micro-batch (the
last, shorter batch; variable sequence lengths), so no rank may guess. Two kinds of message
need different answers:

- **A gradient** has the shape and dtype of the activation it belongs to, which the receiving
  rank sent itself: it is received into a tensor like that activation, with no header at all.
- **An activation** is described by a header of ``3 + 8`` int64 (a zero, dtype, dims,
  shape). Each boundary's stream of activations (from one stage to the next) is in one of two
  modes, and both ends switch on the same rule, from the same headers, so they never disagree:

  - *unsettled*: the header goes alone on the control plane, then the payload on the data
    plane (two messages, the receiver blocked on the header before it can post the payload).
  - *settled*, once ``SETTLE`` activations in a row had the same shape and dtype: the header
    rides at the end of the payload, in one message of the size the receiver expects. If the
    sender's next tensor has another shape, that message carries the new header and no
    payload (its body is not read), the tensor follows on its own, and the stream is
    unsettled again.

  A boundary of constant shape thus costs one message per activation after its first
  ``SETTLE`` (what ``torch.distributed.pipelining`` sends with its shapes fixed ahead); one
  whose shape changes every step pays one message of the old size per change; one that
  changes more often than every ``SETTLE`` messages stays unsettled (settling after one would
  make such a stream pay a notice of the old size for nearly every tensor). Measured on the
  reference GPT's interleaved 1F1B, a header message before every payload cost 5-9% of the
  step (``benchmarks/pipeline_vs_torch.py``).

The payload comes first in a settled message so that the received tensor starts where its
buffer starts (aligned as any allocation); the copy into that buffer is the price of sending
one message instead of two. Sends are asynchronous and never block; a receive blocks when it is
due.

[Note: receives posted ahead] gloo moves a message's bytes only once both ends have posted it:
a send waits for its receive, and a receive posted when its compute needs it waits for the
whole transfer, and for the sender's transport thread to be scheduled, on a machine whose cores
the stages' compute keeps busy. So the runtime posts each receive as soon as it can, before
the compute that comes first, and waits for it only when it is due, as
``torch.distributed.pipelining`` does. Posting needs the receive's size: a gradient's is its
activation's (posted once that activation exists), a settled activation's is its stream's
message (posted once the one before it arrived, so that the stream's mode is known). An
unsettled activation is not posted: its header says its size. One receive is posted at a time,
in the order the schedule receives them, because messages between two ranks are matched in
the order they are posted: a notice of a new shape must be followed by its tensor, not by a
receive already posted for the next message. Its cost is memory: the next receive's buffer is
live during the action before it (the planner counts it there). Measured on the reference
GPT against torch at the same split (``benchmarks/pipeline_vs_torch.py --repeats 4``), posting
ahead took interleaved 1F1B from 1.036x torch's step to 0.948x, GPipe and 1F1B from 1.012x and
0.991x to 1.005x and 0.970x.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from longboat.comm.protocol import Comm, Handle

_MAX_DIMS = 8
_HEADER = 3 + _MAX_DIMS  # int64s: dtype, dims, shape; the first is reserved (0)
HEADER_BYTES = _HEADER * 8
#: activations in a row of one shape before a boundary's header rides with its payload
SETTLE = 3
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]

Shape = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Message:
    """One tensor between neighbouring stages: an activation goes from stage ``s`` to ``s + 1``,
    its gradient back from ``s + 1`` to ``s``. Either has the shape of stage ``s``'s output
    (:attr:`boundary`)."""

    kind: Literal["activation", "gradient"]
    micro_batch: int
    src: int  # stage
    dst: int  # stage

    @property
    def boundary(self) -> int:
        """The stage whose output this tensor (or its gradient) is."""
        return min(self.src, self.dst)

    def sending(self) -> str:
        return f"{self.kind} of micro-batch {self.micro_batch} to stage {self.dst}"

    def receiving(self) -> str:
        return f"{self.kind} of micro-batch {self.micro_batch} from stage {self.src}"


@dataclass
class Stream:
    """One boundary's activations as either end has seen them ([Note: shapes on the wire])."""

    settle: int  # activations in a row of one shape that settle the stream
    last: Shape | None = None
    run: int = 0  # activations in a row of shape ``last``
    settled: bool = False

    def seen(self, shape: Shape) -> bool:
        """Both ends call this for every activation, in the same order; whether it travelled
        settled (the stream was, on this shape)."""
        settled = self.settled and shape == self.last
        if shape == self.last:
            self.run += 1
        else:
            self.last, self.run, self.settled = shape, 1, False
        if self.run >= self.settle:
            self.settled = True
        return settled


def _check(tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"a pipeline stage passes one tensor to the next, got a {type(tensor).__name__}; "
            "return a single tensor from each stage's last layer"
        )
    return tensor


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise TypeError(
            f"a pipeline stage's output of dtype {tensor.dtype} and {tensor.dim()} dims cannot "
            f"be sent; use one of {[str(d) for d in _DTYPES]} with at most {_MAX_DIMS} dims"
        )
    dims = list(tensor.shape)
    values = [0, _DTYPES.index(tensor.dtype), len(dims), *dims] + [-1] * (_MAX_DIMS - len(dims))
    return torch.tensor(values, dtype=torch.int64)  # one small tensor per activation


def _shape_of(header: torch.Tensor) -> Shape:
    values = header.tolist()
    dims = int(values[2])
    return tuple(int(d) for d in values[3 : 3 + dims]), _DTYPES[int(values[1])]


def _nbytes(shape: Shape) -> int:
    dims, dtype = shape
    n = 1
    for d in dims:
        n *= d
    return n * dtype.itemsize


def _wire(at: int, device: torch.device, header: torch.Tensor | None = None) -> torch.Tensor:
    """A settled message's bytes: ``at`` for the payload (not written here), then the header
    (``header`` where given)."""
    wire = torch.empty(at + HEADER_BYTES, dtype=torch.uint8, device=device)
    if header is not None:
        wire[at:].view(torch.int64).copy_(header)
    return wire


def payload_of(wire: torch.Tensor, shape: Shape) -> torch.Tensor:
    """The tensor at the front of a settled message's bytes."""
    return wire[: _nbytes(shape)].view(shape[1]).view(shape[0])


def _padded(shape: Shape) -> int:
    """Where a settled message's header starts: after the payload, at a multiple of 8."""
    return -(-_nbytes(shape) // 8) * 8


class Link:
    """What a pipeline rank exchanges with the others: tensors with its neighbours and the
    step's losses. ``longboat plan`` runs the pipeline with a link of its own
    (:mod:`longboat.plan.stages`)."""

    settle = SETTLE  # see Stream

    def __init__(self, data: Comm, control: Comm, device: torch.device) -> None:
        self.data, self.control, self.device = data, control, device
        # each boundary's activations this rank sends, and those it receives
        self.sent: dict[int, Stream] = {}
        self.received: dict[int, Stream] = {}
        self.posted: Posted | None = None  # the receive posted ahead, not yet received

    def send(self, tensor: torch.Tensor, dst: int, message: Message) -> list[Handle]:
        """Start sending ``tensor`` to pipeline rank ``dst``; the handles (which keep the
        tensors alive) must be waited before the step ends."""
        tensor = _check(tensor)
        what = message.sending()
        if message.kind == "gradient":  # its receiver knows its shape
            payload = tensor.detach().contiguous()
            return [self.data.send(payload, dst, async_op=True, tag=what), _Keep(payload)]
        header = _header(tensor)
        shape: Shape = (tuple(tensor.shape), tensor.dtype)
        stream = self.sent.setdefault(message.boundary, Stream(self.settle))
        expected = stream.last if stream.settled else None  # what the receiver posts for
        if stream.seen(shape):  # one message: the payload, its header at the end
            wire = _wire(_padded(shape), tensor.device, header)
            wire[: _nbytes(shape)].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            return [self.data.send(wire, dst, async_op=True, tag=what), _Keep(wire)]
        handles: list[Handle]
        if expected is not None:  # the receiver expects the old shape: tell it of the new one
            wire = _wire(_padded(expected), tensor.device, header)
            notice = self.data.send(wire, dst, async_op=True, tag=f"new shape of {what}")
            handles = [notice, _Keep(wire)]
        else:
            handles = [self.control.send(header, dst, async_op=True, tag=f"header of {what}")]
        payload = tensor.detach().contiguous()
        handles += [
            self.data.send(payload, dst, async_op=True, tag=what),
            _Keep(header, payload),
        ]
        return handles

    def post(self, src: int, message: Message, like: torch.Tensor | None = None) -> bool:
        """Start receiving ``message`` from pipeline rank ``src`` ahead of :meth:`recv`, if its
        size is known without a header ([Note: receives posted ahead]); whether it was. At
        most one receive is posted at a time; a gradient needs ``like``, the activation it
        belongs to."""
        # recv posts through _post, so that a link that counts what is posted ahead
        # (the planner's) can tell those from receives posted when due.
        return self._post(src, message, like)

    def _post(self, src: int, message: Message, like: torch.Tensor | None) -> bool:
        if self.posted is not None:
            return False
        made = self._buffer(message, like)
        if made is None:
            return False
        buffer, at = made
        handle = self.data.recv(buffer, src, async_op=True, tag=message.receiving())
        self.posted = Posted(message, src, handle, buffer, at)
        return True

    def recv(self, src: int, message: Message, like: torch.Tensor | None = None) -> torch.Tensor:
        """Receive ``message`` from pipeline rank ``src`` (blocking): the receive :meth:`post`
        started, or one started now. A gradient is received into a tensor ``like`` the
        activation it belongs to."""
        posted = self.posted
        if posted is None:
            if not self._post(src, message, like):
                return self._with_header(src, message)
            posted = self.posted
            assert posted is not None
        if posted.message != message or posted.src != src:
            raise RuntimeError(
                f"pipeline: receiving the {message.receiving()}, but the receive posted ahead "
                f"is the {posted.message.receiving()}; receives must be posted in the order "
                "the schedule receives them"
            )
        self.posted = None
        posted.handle.wait()
        if posted.at is None:  # a gradient
            return posted.buffer
        shape = self._header_of(posted)
        if self.received[message.boundary].seen(shape):
            return payload_of(posted.buffer, shape)
        return self._payload(src, message, shape)  # a notice of a new shape: the tensor follows

    def _buffer(
        self, message: Message, like: torch.Tensor | None
    ) -> tuple[torch.Tensor, int | None] | None:
        """What ``message`` is received into where its size is known without a header: a
        gradient's tensor (no header in it), or a settled activation's message bytes and where
        its header starts in them; None for an activation whose header comes first."""
        if message.kind == "gradient":
            if like is None:
                raise ValueError(
                    f"receiving the {message.receiving()}: pass the activation it belongs to"
                )
            return torch.empty(like.shape, dtype=like.dtype, device=self.device), None
        stream = self.received.get(message.boundary)
        if stream is None or not stream.settled:
            return None
        assert stream.last is not None
        at = _padded(stream.last)
        return _wire(at, self.device), at

    def _header_of(self, posted: Posted) -> Shape:
        """The shape a settled activation's received message says (its own or a new one)."""
        assert posted.at is not None
        return _shape_of(posted.buffer[posted.at :].view(torch.int64).cpu())

    def _with_header(self, src: int, message: Message) -> torch.Tensor:
        """An activation of an unsettled stream: its header on the control plane, then it."""
        what = message.receiving()
        stream = self.received.setdefault(message.boundary, Stream(self.settle))
        header = torch.empty(_HEADER, dtype=torch.int64)
        self.control.recv(header, src, tag=f"header of {what}")
        shape = _shape_of(header)
        stream.seen(shape)
        return self._payload(src, message, shape)

    def _payload(self, src: int, message: Message, shape: Shape) -> torch.Tensor:
        """A tensor of ``shape`` alone (no header in its message)."""
        out = torch.empty(shape[0], dtype=shape[1], device=self.device)
        self.data.recv(out, src, tag=message.receiving())
        return out

    def share_losses(self, losses: list[torch.Tensor], m: int, src: int) -> list[float]:
        """The ``m`` micro-batch losses pipeline rank ``src`` (the last stage's) computed, on
        every rank: one small CPU broadcast, and one read of their values per step."""
        t = (
            torch.stack([x.detach().to("cpu", torch.float64) for x in losses])
            if losses
            else torch.zeros(m, dtype=torch.float64)
        )
        self.control.broadcast(t, src=src)
        return t.tolist()


@dataclass
class Posted:
    """A receive :meth:`Link.post` started: into ``buffer``, whose header starts at ``at``
    (an activation's message) or which is the tensor (a gradient, ``at`` None)."""

    message: Message
    src: int
    handle: Handle
    buffer: torch.Tensor
    at: int | None


class _Keep:
    """Holds a send's tensors until the step's end, when every send has been waited."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
