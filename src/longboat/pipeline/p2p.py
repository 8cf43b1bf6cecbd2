"""Tensors between neighbouring stages: a small header on the control plane (shape and dtype, so
the receiver can allocate without any rank guessing), then the tensor on the data plane.

Shapes are negotiated per message rather than once: a stage's output shape may change with the
micro-batch (the last, shorter batch; variable sequence lengths), and a header is a few bytes
on gloo. Sends are asynchronous and never block; receives block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from longboat.comm.protocol import Comm, Handle

_MAX_DIMS = 8
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


def send(data: Comm, control: Comm, tensor: torch.Tensor, dst: int, what: str = "") -> list[Handle]:
    """Start sending ``tensor`` to group rank ``dst``; the handles (which keep the tensors
    alive) must be waited before the step ends."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"a pipeline stage passes one tensor to the next, got a {type(tensor).__name__}; "
            "return a single tensor from each stage's last layer"
        )
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise TypeError(
            f"a pipeline stage's output of dtype {tensor.dtype} and {tensor.dim()} dims cannot "
            f"be sent; use one of {[str(d) for d in _DTYPES]} with at most {_MAX_DIMS} dims"
        )
    header = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    header[0] = _DTYPES.index(tensor.dtype)
    header[1] = tensor.dim()
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    payload = tensor.detach().contiguous()
    return [
        control.send(header, dst, async_op=True, tag=f"header of {what}" if what else ""),
        data.send(payload, dst, async_op=True, tag=what),
        _Keep(header, payload),
    ]


def recv(data: Comm, control: Comm, src: int, device: torch.device, what: str = "") -> torch.Tensor:
    """Receive the tensor group rank ``src`` sends (blocking); ``what`` names it in a hang
    report."""
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
    control.recv(header, src, tag=f"header of {what}" if what else "")
    dims = int(header[1])
    shape = [int(d) for d in header[2 : 2 + dims]]
    out = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    data.recv(out, src, tag=what)
    return out


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


class Link:
    """What a pipeline rank exchanges with the others: tensors with its neighbours (a header on
    the control plane, the payload on the data plane) and the step's losses. ``longboat plan``
    runs the pipeline with a link of its own (:mod:`longboat.plan.stages`)."""

    def __init__(self, data: Comm, control: Comm, device: torch.device) -> None:
        self.data, self.control, self.device = data, control, device

    def send(self, tensor: torch.Tensor, dst: int, message: Message) -> list[Handle]:
        """Start sending ``tensor`` to pipeline rank ``dst``; wait the handles at the step's
        end."""
        return send(self.data, self.control, tensor, dst, message.sending())

    def recv(self, src: int, message: Message) -> torch.Tensor:
        """Receive ``message`` from pipeline rank ``src`` (blocking)."""
        return recv(self.data, self.control, src, self.device, message.receiving())

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


class _Keep:
    """Holds a send's tensors until the step's end, when every send has been waited."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
