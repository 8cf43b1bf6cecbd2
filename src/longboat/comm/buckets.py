"""Bucket plans: which gradients travel together, in which flat buffer, at which offset.

Pure data, testable without processes. A plan fills buckets in the reverse order of parameter
registration, which approximates the order in which backward produces gradients, so the first
bucket is ready (and its all-reduce starts) while backward is still running. The first bucket is
kept small so communication begins early, as DDP does.

[Note: usage flags] A bucket's buffer ends with one slot per parameter after the gradients: 1
where this rank produced a gradient for the parameter in the step, 0 where it did not. The slots
travel in the same all-reduce as the gradients, so after it every rank knows, at no extra
collective, which parameters *some* rank used: those get the averaged gradient (zeros from the
ranks that did not use them, as DDP gives), and a parameter no rank used keeps ``grad = None``,
so the optimizer leaves it and its state alone, as plain PyTorch does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """One flat buffer holding the gradients of several parameters, of one dtype and device."""

    index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int  # gradient elements (the usage flags come after them)
    dtype: torch.dtype
    device: torch.device
    buffer: torch.Tensor | None = None
    handle: object | None = None

    @property
    def size(self) -> int:
        """Elements of the buffer: the gradients, then one usage flag per parameter."""
        return self.numel + len(self.params)

    def allocate(self) -> torch.Tensor:
        """Create the flat buffer (once)."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.size, dtype=self.dtype, device=self.device)
        return self.buffer

    def flags(self) -> torch.Tensor:
        """The usage flags of [Note: usage flags], one per parameter, in ``params`` order."""
        assert self.buffer is not None, "allocate() first"
        return self.buffer[self.numel: self.size]

    def view_of(self, i: int) -> torch.Tensor:
        """The slice of the flat buffer that holds parameter ``i``'s gradient, shaped like it."""
        p = self.params[i]
        assert self.buffer is not None, "allocate() first"
        return self.buffer[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)


@dataclass
class BucketPlan:
    """Buckets plus, for each parameter, the (bucket index, position) where its gradient lives."""

    buckets: list[Bucket]
    where: dict[int, tuple[int, int]] = field(default_factory=dict)

    def locate(self, p: torch.nn.Parameter) -> tuple[Bucket, int]:
        b, i = self.where[id(p)]
        return self.buckets[b], i


def plan_buckets(
    params: list[torch.nn.Parameter], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> BucketPlan:
    """Group trainable ``params`` into buckets of about ``bucket_bytes`` each.

    Parameters are taken in reverse order; a bucket closes when adding the next parameter would
    pass its cap, or the dtype or device changes. A parameter larger than the cap gets a bucket
    of its own. Every rank computes the same plan from the same model, so the buckets (and the
    order their collectives are launched in) match across ranks.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    where: dict[int, tuple[int, int]] = {}
    current: list[torch.nn.Parameter] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if not current:
            return
        offsets, off = [], 0
        for p in current:
            offsets.append(off)
            off += p.numel()
        b = Bucket(len(buckets), current, offsets, off, current[0].dtype, current[0].device)
        for i, p in enumerate(current):
            where[id(p)] = (b.index, i)
        buckets.append(b)
        current, size = [], 0

    seen: set[int] = set()
    for p in reversed(params):
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))  # a tied parameter appears once
        cap = first_bucket_bytes if (first_bucket_bytes and not buckets) else bucket_bytes
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            close()
        current.append(p)
        size += nbytes
    close()
    return BucketPlan(buckets, where)
