"""Exact distributed evaluation: every sample counted once, whatever the world size.

[Note: exact evaluation] ``DistributedSampler`` pads a dataset that does not divide by the world
size with repeated samples, so an evaluation summed over ranks counts some twice. Here rank ``r``
of ``n`` takes positions ``r, r+n, r+2n, ...`` of the dataset in order, and nothing more: the
shards are disjoint and cover it. Every rank still yields the same number of batches (the most
any rank needs): a rank whose shard ended yields batches of no samples (its collate of one sample
cut to length 0), so forwards that are collective (ZeRO-3's gathers) stay matched on every rank.
Metrics are then summed over the data-parallel ranks with :func:`reduce_metrics`: sums (correct
answers, a loss with ``reduction="sum"``, a count), divided after the reduction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from longboat.comm.protocol import Comm
from longboat.data import to_device


class EvalLoader:
    """This rank's disjoint share of ``dataset`` in batches of ``batch_size`` (see [Note: exact
    evaluation])."""

    def __init__(
        self,
        dataset: Dataset[Any],
        rank: int,
        world_size: int,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError("engine.eval_loader needs a map-style dataset with __len__")
        if batch_size < 1:
            raise ValueError(f"eval_loader batch_size={batch_size}: use 1 or more")
        self.dataset = dataset
        self.indices = list(range(rank, len(dataset), world_size))
        most = -(-len(dataset) // world_size)  # the largest share, rank 0's
        self.batches = -(-most // batch_size)
        self.batch_size = batch_size
        self.collate = collate_fn or default_collate
        self.device = device

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[Any]:
        for b in range(self.batches):
            ids = self.indices[b * self.batch_size : (b + 1) * self.batch_size]
            if ids:
                batch = self.collate([self.dataset[i] for i in ids])
            else:  # this rank's share ended: a batch of no samples keeps the ranks in step
                batch = _empty(self.collate([self.dataset[0]]))
            yield batch if self.device is None else to_device(batch, self.device)


def _empty(batch: Any) -> Any:
    """``batch`` with every tensor cut to 0 rows."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, Mapping):
        return {k: _empty(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [_empty(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def reduce_metrics(values: Mapping[str, float | torch.Tensor], comm: Comm) -> dict[str, float]:
    """Each value summed over the ranks of ``comm`` (one small collective), as floats."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if comm.world_size > 1:
        comm.all_reduce(t)
    return dict(zip(keys, t.tolist(), strict=True))


__all__ = ["EvalLoader", "reduce_metrics"]
