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

from collections.abc import Callable, Hashable, Iterable
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
        return self.buffer[self.numel : self.size]

    def view_of(self, i: int) -> torch.Tensor:
        """The slice of the flat buffer that holds parameter ``i``'s gradient, shaped like it."""
        p = self.params[i]
        assert self.buffer is not None, "allocate() first"
        return self.buffer[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


@dataclass
class BucketPlan:
    """Buckets plus, for each parameter, the (bucket index, position) where its gradient lives."""

    buckets: list[Bucket]
    where: dict[int, tuple[int, int]] = field(default_factory=dict)

    def locate(self, p: torch.nn.Parameter) -> tuple[Bucket, int]:
        b, i = self.where[id(p)]
        return self.buckets[b], i


def group_params(
    params: Iterable[torch.nn.Parameter],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
    key: Callable[[torch.nn.Parameter], Hashable] = lambda p: (p.dtype, p.device),
) -> list[list[torch.nn.Parameter]]:
    """Trainable ``params`` in buckets of about ``cap_bytes``, the one grouping every strategy
    uses (replicate's buckets, ZeRO's stage-1/2 units).

    Parameters are taken in reverse order (about the order backward produces their gradients);
    each ``key`` (dtype and device; ZeRO adds the param group) fills a bucket of its own, which
    closes when the next parameter would pass the cap. Until the first bucket closes the cap is
    ``first_cap_bytes`` (small, so communication starts early). A parameter larger than the cap
    gets a bucket of its own; tied parameters appear once, frozen ones not at all. Buckets are
    listed in the order they close (the rest at the end), which is the order they are launched
    in. Every rank computes the same grouping from the same model.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {cap_bytes} bytes")
    out: list[list[torch.nn.Parameter]] = []
    open_: dict[Hashable, tuple[list[torch.nn.Parameter], int]] = {}
    seen: set[int] = set()
    for p in reversed(list(params)):
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        k = key(p)
        current, size = open_.get(k, ([], 0))
        cap = first_cap_bytes if (first_cap_bytes and not out) else cap_bytes
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            out.append(current)
            current, size = [], 0
        current.append(p)
        open_[k] = (current, size + nbytes)
    out.extend(current for current, _ in open_.values() if current)
    return out


def plan_buckets(
    params: list[torch.nn.Parameter], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> BucketPlan:
    """Replicate's buckets: :func:`group_params` by dtype and device, each with a flat buffer
    layout (offsets) and the place of every parameter's gradient in it."""
    buckets: list[Bucket] = []
    where: dict[int, tuple[int, int]] = {}
    for group in group_params(params, bucket_bytes, first_bucket_bytes):
        offsets, off = [], 0
        for p in group:
            offsets.append(off)
            off += p.numel()
        b = Bucket(len(buckets), group, offsets, off, group[0].dtype, group[0].device)
        for i, p in enumerate(group):
            where[id(p)] = (b.index, i)
        buckets.append(b)
    return BucketPlan(buckets, where)
