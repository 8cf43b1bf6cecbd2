"""The script's own ``DataLoader``, used as it is once every rank agrees it is sharded as the mesh
is.

[Note: your DataLoader] A ``DataLoader`` built with a ``DistributedSampler`` is already sharded:
``engine.loader(dataloader)`` checks that the sampler's ``num_replicas`` and ``rank`` are the
data-parallel mesh's (every rank hears every rank's verdict, so a mismatch on some ranks only is
refused on all of them, never left to hang), that its ``batch_size`` is the engine's micro-batch
(``engine.step`` counts micro-batches), and then hands out its batches as they come, calling
``sampler.set_epoch(epoch)`` before each epoch. Its sampler, ``drop_last``, workers and
``collate_fn`` are its own (``data.shuffle``, ``data.num_workers`` and ``'drop'``/``'pad'`` do not
apply; ``'join'`` still runs the loop through the join). Resuming mid-epoch loads the epoch's
first batches again and drops them. A ``DataLoader`` without a ``DistributedSampler`` is refused
(every rank would read all of it, and a shuffling one in a different order on each rank): pass
its data set instead, which is sharded here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from longboat.data.loader import Loader


def distributed_sampler(loader: DataLoader[Any]) -> DistributedSampler[int] | None:
    """The ``DistributedSampler`` a ``DataLoader`` draws from (directly, or inside its batch
    sampler), or None."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def dataloader_problem(
    loader: DataLoader[Any],
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    per_step: bool,
    shuffle: bool | None,
    collate_fn: Callable[..., Any] | None,
) -> str | None:
    """Why ``engine.loader(loader)`` cannot use ``loader`` on data-parallel rank ``rank`` of
    ``world_size`` with batches of ``batch_size``, or None ([Note: your DataLoader])."""
    sampler = distributed_sampler(loader)
    build = f"DistributedSampler(dataset, num_replicas={world_size}, rank={rank})"
    if sampler is None:
        what = type(loader.sampler).__name__
        return (
            f"the DataLoader's sampler is a {what}, not a DistributedSampler: every rank would "
            "read all of it. Pass its data set instead, engine.loader(loader.dataset, "
            "collate_fn=...), which is sharded by rank and reshuffled every epoch; or build "
            f"the DataLoader with sampler={build}"
        )
    if (sampler.num_replicas, sampler.rank) != (world_size, rank):
        return (
            f"the DataLoader's DistributedSampler has num_replicas={sampler.num_replicas}, "
            f"rank={sampler.rank}, but this process is data-parallel rank {rank} of "
            f"{world_size} (mesh.dp = {world_size}): build it with {build}, or pass its data "
            "set to engine.loader"
        )
    if loader.batch_size is not None and loader.batch_size != batch_size:
        want = (
            f"a whole step per rank, {batch_size} samples (per_step=True: batch.micro_batch_size "
            "x accumulation)"
            if per_step
            else f"batch.micro_batch_size = {batch_size}"
        )
        return (
            f"the DataLoader's batch_size={loader.batch_size}, but a batch here is {want}; "
            "engine.step counts batches, so the global batch would not be "
            f"batch.train_batch_size: build the DataLoader with batch_size={batch_size}"
        )
    if shuffle is not None:
        return (
            f"engine.loader(dataloader, shuffle={shuffle}): the DataLoader's sampler orders its "
            "samples; give shuffle to its DistributedSampler instead"
        )
    if collate_fn is not None:
        return (
            "engine.loader(dataloader, collate_fn=...): the DataLoader collates its own "
            "batches; give collate_fn to the DataLoader instead"
        )
    return None


def refusal(problems: list[str | None]) -> str | None:
    """One message for every rank's :func:`dataloader_problem` (rank order), or None."""
    by_text: dict[str, list[int]] = {}
    for r, p in enumerate(problems):
        if p is not None:
            by_text.setdefault(p, []).append(r)
    if not by_text:
        return None
    lines = [f"rank(s) {', '.join(map(str, ranks))}: {p}" for p, ranks in by_text.items()]
    more = f"\n  ... and {len(lines) - 4} more" if len(lines) > 4 else ""
    return "engine.loader cannot use this DataLoader:\n  " + "\n  ".join(lines[:4]) + more


class UserLoader(Loader):
    """The script's own ``DataLoader`` built with a ``DistributedSampler`` that agrees with the
    data-parallel mesh ([Note: your DataLoader]): its batches as they come, the sampler's
    ``set_epoch`` called before each epoch; resuming mid-epoch loads the epoch's first batches
    again and drops them."""

    def __init__(
        self, loader: DataLoader[Any], batch_size: int, device: torch.device | None = None
    ) -> None:
        sampler = distributed_sampler(loader)
        assert sampler is not None, "checked by dataloader_problem"
        super().__init__(loader.batch_size or batch_size, sampler.num_replicas, device)
        self.loader = loader
        self.sampler = sampler

    def _begin(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        # A DataLoader cannot start mid-epoch: skip what the epoch had handed out.
        return itertools.islice(iter(self.loader), self.position, None)

    def __len__(self) -> int:
        return len(self.loader)
