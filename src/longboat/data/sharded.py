"""The loader of a map-style data set: this rank's shard of a seeded per-epoch permutation.

[Note: shards] Rank ``r`` of ``n`` takes positions ``r, r+n, r+2n, ...`` of one permutation that
every rank draws from the same seed and epoch (as ``DistributedSampler`` does). With micro-batches
of ``b``, micro-batch ``t`` on all ranks together is then exactly positions ``t*b*n ...
(t+1)*b*n - 1`` of the permutation: the same samples a single process with a batch of ``b*n``
would see at step ``t``. That is what lets every strategy be compared with ``single``.

[Note: worker randomness] With worker processes (``data.num_workers > 0``) a dataset that draws
random numbers in ``__getitem__`` (augmentations) would draw them from each worker's own stream,
which depends on which worker got which batch and restarts when a run resumes mid-epoch, so a
resumed run would see other draws than the run it continues. Instead, each sample is loaded with
torch's, Python's and NumPy's generators seeded from the data seed, the epoch and the sample's
position in the epoch's permutation: the same draws whatever the number of workers, and after a
resume. (Without workers, samples draw from the training process's generators, which checkpoints
restore.)

[Note: regrouped loader] When in-job recovery (``longboat/recovery/``) continues an epoch on fewer
ranks (or more, when a replacement joins at a step boundary), the samples the epoch consumed so far
(``offset``, the same on every survivor) stay consumed and the rest of the permutation is dealt over
the new ranks as at the start of an epoch: rank ``r`` of ``n`` takes positions ``offset + r, offset
+ r + n, ...``. So the step the failure interrupted is redone on the survivors' ranks from its first
sample, and no sample is lost or seen twice. The epoch's end is recounted in whole steps of the new
size from ``offset``. The live iteration of the training loop picks the change up at its next batch;
at an epoch's very end nothing is re-dealt: the next epoch begins over the new ranks. A
replacement's new loader is placed at the others' position before its first iteration.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from longboat.data.loader import Loader, Remainder, _worker_kwargs

log = logging.getLogger("longboat")


class ShardedSampler(Sampler[int]):
    """This rank's indices of a seeded per-epoch permutation, trimmed or padded to whole steps
    (``remainder='join'``: neither; the last step's samples go to the ranks they fall on, so a
    rank may have fewer, or a partial last micro-batch)."""

    def __init__(
        self,
        length: int,
        rank: int,
        world_size: int,
        step_samples: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        remainder: Remainder = "drop",
    ) -> None:
        if step_samples % world_size:
            raise ValueError(
                f"samples per step ({step_samples}) must be divisible by world size {world_size}"
            )
        if remainder == "drop" and length < step_samples:
            raise ValueError(
                f"the data set has {length} samples, fewer than one step's {step_samples}; "
                "use a smaller batch, or data.remainder = 'pad'"
            )
        self.length, self.rank, self.world_size = length, rank, world_size
        self.step_samples, self.shuffle, self.seed = step_samples, shuffle, seed
        self.remainder = remainder
        self.epoch = 0
        self.start = 0  # positions of this rank's shard to skip (resuming mid-epoch)
        self.offset = 0  # positions of the permutation consumed before a regroup
        # [Note: worker randomness]: yield (index, epoch, position) for _SeededSamples
        self.tagged = False
        self.count_from(0)

    def count_from(self, offset: int) -> None:
        """The epoch's samples (``total``, padded or trimmed to whole steps from ``offset``)."""
        length, step_samples, remainder = self.length, self.step_samples, self.remainder
        whole = offset + (length - offset) // step_samples * step_samples
        self.total = (
            whole
            if remainder == "drop"
            else length
            if remainder == "join" or whole == length
            else whole + step_samples
        )
        self.leftover = length - whole

    def regroup(self, rank: int, world_size: int) -> None:
        """Deal positions over ``world_size`` ranks from now on, this one rank ``rank``
        ([Note: regrouped loader])."""
        self.step_samples = self.step_samples // self.world_size * world_size
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        """Choose the permutation of ``epoch`` (the loader does this by itself)."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        if self.total > self.length:  # pad by repeating from the start of the permutation
            order += (order * (self.total // self.length + 1))[: self.total - self.length]
        order = order[: self.total]
        mine = order[self.offset + self.rank :: self.world_size][self.start :]
        if not self.tagged:
            return iter(mine)
        # global position of mine[0]
        first = self.offset + self.rank + self.start * self.world_size
        return iter(
            (i, self.epoch, first + k * self.world_size)  # type: ignore[misc]
            for k, i in enumerate(mine)
        )

    def __len__(self) -> int:
        return max(len(range(self.offset + self.rank, self.total, self.world_size)) - self.start, 0)


def _seed_all(seed: int, epoch: int, position: int) -> None:
    """Seed torch's, Python's and NumPy's generators from a place in an epoch
    ([Note: worker randomness], [Note: streams] in ``stream.py``)."""
    s = ((seed * 1_000_003 + epoch) * 10_000_019 + position) % 2**63
    torch.manual_seed(s)
    random.seed(s)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(s % 2**32)


class _SeededSamples(Dataset[Any]):
    """``dataset`` whose samples load with generators seeded by their place in the epoch
    ([Note: worker randomness])."""

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int, int]) -> Any:
        index, epoch, position = key
        _seed_all(self.seed, epoch, position)
        return self.dataset[index]


class ShardedLoader(Loader):
    """A ``DataLoader`` over this rank's shard of a map-style data set ([Note: shards]).

    Its checkpointed position also holds the generator the workers' seeds come from."""

    def __init__(
        self,
        dataset: Dataset[Any],
        sampler: ShardedSampler,
        batch_size: int,
        seed: int,
        rank: int,
        device: torch.device | None = None,
        **loader_kwargs: Any,
    ) -> None:
        super().__init__(batch_size, sampler.world_size, device)
        self.sampler = sampler
        generator = torch.Generator().manual_seed(seed * 1000003 + rank)  # per-rank worker RNG
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=False,
            generator=generator,
            **loader_kwargs,
        )
        self._generator = generator
        # Each iteration draws the workers' base seed from the generator first: a resumed epoch
        # must start from the state the interrupted one started from.
        self._epoch_rng = generator.get_state()

    def _begin(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.sampler.offset = self._offset
        self.sampler.count_from(self._offset)
        self.sampler.start = self.position * self.batch_size
        self._epoch_rng = self._generator.get_state()
        return iter(self.loader)

    def _end(self) -> None:
        self.sampler.start = 0
        self.sampler.offset = 0

    def where(self) -> tuple[int, int]:
        samples = self.samples
        if samples >= self.sampler.total:  # the epoch is over; the next one starts at 0
            return self.epoch + 1, 0
        return self.epoch, samples

    def regroup(self, rank: int, world_size: int, epoch: int, samples: int) -> None:
        self.world_size = world_size
        self.sampler.regroup(rank, world_size)
        if (epoch, samples) == (self.epoch + 1, 0):
            return  # the epoch ran out at a step boundary: the next one deals over the new ranks
        self._restart = (epoch, samples)

    def place(self, epoch: int, samples: int) -> None:
        self.epoch, self._offset, self.position, self._skip = epoch, samples, 0, 0

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as JSON-ready values."""
        mid_epoch = self.position > 0
        rng = self._epoch_rng if mid_epoch else self._generator.get_state()
        return {**super().state_dict(), "generator": rng.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`state_dict`) at the next iteration."""
        super().load_state_dict(state)
        if "generator" in state:  # a stream's position has none
            self._generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
        self._epoch_rng = self._generator.get_state()


def _joined_step(leftover: int, world_size: int, micro_batch_size: int) -> str:
    """What ``remainder='join'`` does with an epoch's last ``leftover`` samples, in words."""
    shares = [len(range(r, leftover, world_size)) for r in range(world_size)]
    micro = [-(-k // micro_batch_size) for k in shares]
    return (
        f"the last step's {leftover} samples stay where they fall ({', '.join(map(str, micro))} "
        "micro-batch(es) on ranks "
        f"0..{world_size - 1}); a rank that runs out first shadows the others until all are done"
    )


def make_loader(
    dataset: Dataset[Any],
    *,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    train_batch_size: int,
    shuffle: bool,
    seed: int,
    remainder: Remainder,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    collate_fn: Callable[..., Any] | None = None,
    announce: bool = True,
    device: torch.device | None = None,
) -> ShardedLoader:
    """Build the sharded loader of a map-style data set and say, once, what it does with the
    remainder."""
    if not isinstance(dataset, Sized) or isinstance(dataset, IterableDataset):
        raise TypeError(
            f"engine.loader takes a map-style data set (with __len__ and __getitem__), a "
            f"torch IterableDataset, or a DataLoader built with a DistributedSampler; got a "
            f"{type(dataset).__name__}"
        )
    sampler = ShardedSampler(
        len(dataset),
        rank,
        world_size,
        train_batch_size,
        shuffle=shuffle,
        seed=seed,
        remainder=remainder,
    )
    if announce:
        steps = -(-sampler.total // train_batch_size)
        what = (
            "none"
            if sampler.leftover == 0
            else f"the last {sampler.leftover} samples of each epoch's permutation are dropped"
            if remainder == "drop"
            else f"the last step is padded with {train_batch_size - sampler.leftover} repeated "
            "samples"
            if remainder == "pad"
            else _joined_step(sampler.leftover, world_size, micro_batch_size)
        )
        log.info(
            "loader: %d samples, %d per step (%d per rank per micro-batch) -> %d steps per "
            "epoch; remainder: %s (data.remainder=%r)",
            len(dataset),
            train_batch_size,
            micro_batch_size,
            steps,
            what,
            remainder,
        )
    if num_workers:  # [Note: worker randomness]
        sampler.tagged = True
        dataset = _SeededSamples(dataset, seed)
    kwargs = _worker_kwargs(num_workers, prefetch_factor, persistent_workers, collate_fn, device)
    return ShardedLoader(dataset, sampler, micro_batch_size, seed, rank, device, **kwargs)
