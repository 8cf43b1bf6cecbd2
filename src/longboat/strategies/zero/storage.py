"""Freeing a tensor's memory while the tensor, and every view of it, lives on.

[Note: storage resize] A gathered ZeRO-3 unit is used by autograd after the unit is freed: the
backward of its forward holds views of the gathered buffer (weights saved for a matmul's
backward). Freeing a buffer by dropping the tensor would keep it alive through those views (no
memory saved), and reusing it for another unit would hand those views the other unit's values.
So a buffer's *storage* is resized to zero bytes to free it and back to its size before it is
filled again with the same unit's values (as FSDP frees its unsharded parameters): the views
stay valid and see the refilled values. Shards offloaded to disk are freed the same way.

The resize goes through ``torch.ops.inductor.resize_storage_bytes_`` where torch has it, an
operator that dispatch modes see (``longboat plan`` counts live bytes with one), and through the
storage's own ``resize_`` otherwise.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from longboat.heap import advise_huge_pages

_OP = getattr(getattr(torch.ops, "inductor", None), "resize_storage_bytes_", None)


def _resize(t: torch.Tensor, nbytes: int) -> None:
    try:
        if _OP is not None:
            _OP(t, nbytes)
            return
    except (AttributeError, RuntimeError):  # an older torch without the operator's kernel
        pass
    t.untyped_storage().resize_(nbytes)


def huge_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a CPU buffer just allocated, not written yet) asked for huge pages ([Note: huge
    pages for unit buffers] in ``heap.py``); ``t`` itself."""
    if t.device.type == "cpu" and not isinstance(t, FakeTensor):
        storage = t.untyped_storage()
        advise_huge_pages(storage.data_ptr(), storage.nbytes())
    return t


def empty(numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A new flat buffer for one use, its contents undefined (huge pages on the CPU)."""
    return huge_pages(torch.empty(numel, dtype=dtype, device=device))


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory; ``t`` and its views stay, holding nothing until refilled."""
    if t.untyped_storage().nbytes():
        _resize(t, 0)


def alloc_storage(t: torch.Tensor) -> None:
    """Give a freed ``t`` (contiguous, from offset 0) its memory back, contents undefined."""
    need = t.numel() * t.element_size()
    if t.untyped_storage().nbytes() != need:
        _resize(t, need)
        huge_pages(t)


def has_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


__all__ = ["alloc_storage", "empty", "free_storage", "has_storage", "huge_pages"]
