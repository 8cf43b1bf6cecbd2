"""Tensors between neighbouring stages: a small header on the control plane (shape and dtype, so
the receiver can allocate without any rank guessing), then the tensor on the data plane.

Shapes are negotiated per message rather than once: a stage's output shape may change with the
micro-batch (the last, shorter batch; variable sequence lengths), and a header is a few bytes
on gloo. Sends are asynchronous and never block; receives block.
"""

from __future__ import annotations

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


class _Keep:
    """Holds a send's tensors until the step's end, when every send has been waited."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True
