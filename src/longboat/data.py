"""Sharded, epoch-aware data loading: a map-style data set, a stream, or the script's own
``DataLoader``.

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

[Note: streams] A stream (a ``torch.utils.data.IterableDataset``: Hugging Face ``datasets`` in
streaming mode, WebDataset, records from a generator) has no length and no random access, so it
is neither permuted nor indexed: [Note: shards] holds with the stream's own order for the
permutation. Sample ``i`` of an epoch goes to data-parallel rank ``i % n``, and the rank's
micro-batch ``t`` is its samples among positions ``t*b*n ... (t+1)*b*n - 1``: the batches of a
map-style data set of the same samples under ``shuffle = False``. Every process that loads
batches (the rank's training process, or each of its ``W`` worker processes) reads the whole
stream and keeps its share; worker ``w`` builds the rank's micro-batches ``w, w+W, ...``, which
the ``DataLoader`` hands out in turn, so the batches and their order do not depend on ``W``. This
is a partition only if the stream yields the same samples in the same order in every process
that reads it, for a given epoch: shuffle inside the stream with a seed (``datasets``'
``shuffle(seed=..., buffer_size=...)``, which ``set_epoch`` varies by epoch). To that end:

* ``set_epoch(epoch)`` is called on the data set, where it has that method, in each process that
  reads it, before each epoch (persistent workers too).
* A worker process seeds torch's, Python's and NumPy's generators from the data seed and the
  epoch before it reads: the same in every worker of every rank, so draws made while streaming
  agree between readers, and a resumed epoch draws what the interrupted one drew. (Without
  workers the stream draws from the training process's generators.)
* Torch's worker info is hidden from the stream while it is read: a stream that splits itself
  among worker processes (``datasets``, WebDataset's ``split_by_worker``) would otherwise give
  each worker a part of itself, of which the worker would keep only its share again.

Hand ``engine.loader`` the whole stream, not one already split by node
(``split_dataset_by_node``, WebDataset's ``split_by_node``): it is split here. Every reader reads
every sample, so ``n x W`` readers read the stream ``n x W`` times; where reading, not decoding,
is what costs, prefer fewer workers. The end of an epoch (``data.remainder``):

* ``'drop'``: a step the stream does not fill is dropped. A reader holds each micro-batch until
  the stream has reached the end of its step (at most one step's samples), so every rank drops
  the same step. A stream with fewer samples than one step is refused at the end of the epoch.
* ``'pad'``: the last step is filled by reading the stream's beginning again (in a cycle, for a
  stream shorter than the padding), as the map-style loader repeats its permutation's start.
* ``'join'``: the last step's samples stay on the ranks they fall to, the last micro-batch of a
  rank may be partial, and [Note: joining] in ``join.py`` lets ranks run out at different times.

A stream has no ``len()`` (the loader raises ``TypeError``), and ``shuffle=True`` is refused
(``data.shuffle`` does not apply to it). Resuming mid-epoch reads the epoch's consumed samples
again and skips them: a stream cannot seek.

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

import contextlib
import itertools
import logging
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.utils.data._utils.worker as _torch_worker
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    default_collate,
    get_worker_info,
)

from longboat.config.errors import ConfigError
from longboat.config.sections import DataConfig

log = logging.getLogger("longboat")
_NULL = contextlib.nullcontext()
_END = object()
Remainder = Literal["drop", "pad", "join"]


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
        # [Note: worker randomness]: yield (index, epoch, position) for _SeededSamples
        self.tagged = False
        whole = length // step_samples * step_samples
        self.total = (
            whole
            if remainder == "drop"
            else length
            if remainder == "join" or whole == length
            else whole + step_samples
        )
        self.leftover = length - whole

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
        mine = order[self.rank :: self.world_size][self.start :]
        if not self.tagged:
            return iter(mine)
        first = self.rank + self.start * self.world_size  # global position of mine[0]
        return iter(
            (i, self.epoch, first + k * self.world_size)  # type: ignore[misc]
            for k, i in enumerate(mine)
        )

    def __len__(self) -> int:
        return max(len(range(self.rank, self.total, self.world_size)) - self.start, 0)


def _seed_all(seed: int, epoch: int, position: int) -> None:
    """Seed torch's, Python's and NumPy's generators from a place in an epoch
    ([Note: worker randomness], [Note: streams])."""
    s = ((seed * 1_000_003 + epoch) * 10_000_019 + position) % 2**63
    torch.manual_seed(s)
    random.seed(s)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(s % 2**32)


class _SeededSamples(Dataset):
    """``dataset`` whose samples load with generators seeded by their place in the epoch
    ([Note: worker randomness])."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int, int]) -> Any:
        index, epoch, position = key
        _seed_all(self.seed, epoch, position)
        return self.dataset[index]


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


class Loader:
    """What :meth:`Engine.loader` returns: one epoch of this rank's batches per iteration (the
    epoch advances by itself), moved to the rank's device (a no-op on the CPU).

    Its position (epoch, samples consumed in the epoch over all ranks) is what a checkpoint
    records: :meth:`load_state_dict` makes the next iteration continue the epoch where the saved
    one stood, at this or another world size. Subclasses say how an epoch begins."""

    def __init__(self, batch_size: int, world_size: int, device: torch.device | None) -> None:
        self.batch_size = batch_size  # samples per batch on each rank
        self.world_size = world_size  # data-parallel ranks
        self.device = device
        self.epoch = 0
        self.position = 0  # batches handed out so far in this epoch
        self._skip = 0  # batches to skip at the next iteration (set by load_state_dict)
        # Set by the engine when the wall-clock breakdown is on: a context timing each fetch.
        self.on_fetch: Callable[[], AbstractContextManager[Any]] | None = None
        # Set by the engine under data.remainder = 'join': what every iteration's batches go
        # through (the engine's join, [Note: joining] in join.py).
        self.through: Callable[[Iterable[Any]], Iterator[Any]] | None = None

    def __iter__(self) -> Iterator[Any]:
        batches = self._batches()
        return batches if self.through is None else self.through(batches)

    def _begin(self) -> Iterator[Any]:
        """The epoch's batches from ``self.position`` on."""
        raise NotImplementedError

    def _end(self) -> None:
        """After the epoch, or after leaving it early."""

    def _ended(self, handed: int) -> None:
        """After an epoch that ran to its end, having handed out ``handed`` batches."""

    def _batches(self) -> Iterator[Any]:
        self.position, self._skip = self._skip, 0
        first = self.position
        it = self._begin()
        cpu = self.device is None or self.device.type == "cpu"
        try:
            while True:
                # The profiler times the fetch (and the copy to the device) as data loading.
                with self.on_fetch() if self.on_fetch is not None else _NULL:
                    batch = next(it, _END)
                    if batch is _END:
                        break
                    if not cpu:
                        batch = to_device(batch, self.device)
                self.position += 1
                yield batch
        finally:
            self._end()
        self._ended(self.position - first)
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as JSON-ready values."""
        return {"epoch": self.epoch, "samples": self.position * self.batch_size * self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`state_dict`) at the next iteration."""
        per_batch = self.batch_size * self.world_size
        samples = int(state["samples"])
        if samples % per_batch:
            raise ValueError(
                f"the saved loader stood {samples} samples into epoch {state['epoch']}, which "
                f"is not a whole number of micro-batches of {self.batch_size} x "
                f"{self.world_size} ranks here; resume with a batch size that divides it"
            )
        self.epoch = int(state["epoch"])
        self._skip = samples // per_batch
        self.position = self._skip


class ShardedLoader(Loader):
    """A ``DataLoader`` over this rank's shard of a map-style data set ([Note: shards]).

    Its checkpointed position also holds the generator the workers' seeds come from."""

    def __init__(
        self,
        dataset: Dataset,
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
        self.sampler.start = self.position * self.batch_size
        self._epoch_rng = self._generator.get_state()
        return iter(self.loader)

    def _end(self) -> None:
        self.sampler.start = 0

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


# -- streams ([Note: streams]) ---------------------------------------------------------------


def shard_stream(
    read: Callable[[], Iterable[Any]],
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    step_samples: int,
    remainder: Remainder,
    start: int = 0,
    worker: int = 0,
    workers: int = 1,
    collate: Callable[[list[Any]], Any] = default_collate,
    told: Callable[[int], None] | None = None,
) -> Iterator[Any]:
    """The micro-batches that reader ``worker`` of ``workers`` on data-parallel rank ``rank``
    builds from the stream ``read()`` gives (each call reads it again from its beginning),
    skipping its first ``start`` samples (a whole number of micro-batches over all ranks);
    ``told`` hears the stream's length when it ends. See [Note: streams]."""
    per = batch_size * world_size  # stream positions of one micro-batch over all ranks
    first = start // per
    mine: list[Any] = []  # this reader's samples of the micro-batch being filled
    held: deque[tuple[int, Any]] = deque()  # its whole micro-batches, by index, not yet due

    def due(t: int) -> int:
        """How far the stream must have come before micro-batch ``t`` is handed out."""
        end = (t + 1) * per
        return -(-end // step_samples) * step_samples if remainder == "drop" else end

    def place(p: int, sample: Any) -> Iterator[Any]:
        """Sample ``p`` of the stream: keep it if it is this reader's; hand out what is due."""
        nonlocal mine
        t, k = divmod(p, per)
        if p >= start and p % world_size == rank and (t - first) % workers == worker:
            mine.append(sample)
        if k == per - 1:
            if mine:
                held.append((t, collate(mine)))
                mine = []
            while held and due(held[0][0]) <= p + 1:
                yield held.popleft()[1]

    length = 0
    for length, sample in enumerate(read(), 1):
        yield from place(length - 1, sample)
    if told is not None:
        told(length)
    if remainder == "pad" and length % step_samples:
        p, end = length, -(-length // step_samples) * step_samples
        while p < end:  # the stream's beginning again, in a cycle if it is short
            before = p
            for sample in itertools.islice(read(), end - p):
                yield from place(p, sample)
                p += 1
            if p == before:  # it yields nothing now: nothing to pad with
                break
    elif remainder == "join" and mine:  # the rank's partial last micro-batch
        yield collate(mine)
    # 'drop': the micro-batches held for a step the stream did not fill are dropped.


def _unsplit(dataset: Iterable[Any]) -> Iterator[Any]:
    """All of ``dataset``'s samples, also in a worker process: torch's worker info is hidden
    from it while it runs (see [Note: streams])."""
    info = _torch_worker._worker_info
    if info is None:
        yield from dataset
        return
    try:
        _torch_worker._worker_info = None
        it = iter(dataset)
        while True:
            _torch_worker._worker_info = None
            try:
                sample = next(it)
            except StopIteration:
                return
            finally:
                _torch_worker._worker_info = info
            yield sample
    finally:
        _torch_worker._worker_info = info


class _StreamReader(IterableDataset):
    """What each process that loads a rank's batches of a stream iterates: its micro-batches
    ([Note: streams]), read in the training process or in each worker process."""

    def __init__(
        self,
        dataset: IterableDataset,
        *,
        seed: int,
        collate: Callable[[list[Any]], Any],
        **shard: Any,
    ) -> None:
        self.dataset = dataset
        self.seed = seed
        self.collate = collate
        self.shard = shard
        # The epoch and the samples to skip, written by the training process before each
        # epoch, and the stream's length, written by the readers at its end: in shared memory,
        # so that persistent workers see each new epoch and the training process the length.
        self.state = torch.tensor([0, 0, -1], dtype=torch.int64).share_memory_()

    def __iter__(self) -> Iterator[Any]:
        epoch, start = int(self.state[0]), int(self.state[1])
        info = get_worker_info()
        if info is not None:  # the same draws in every reader: [Note: streams]
            _seed_all(self.seed, epoch, -1)
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        return shard_stream(
            lambda: _unsplit(self.dataset),
            **self.shard,
            start=start,
            worker=0 if info is None else info.id,
            workers=1 if info is None else info.num_workers,
            collate=self.collate,
            told=self._told,
        )

    def _told(self, length: int) -> None:
        self.state[2] = length


def _as_is(batch: Any) -> Any:
    """The reader's batches are collated already."""
    return batch


class StreamLoader(Loader):
    """This rank's micro-batches of a stream, an ``IterableDataset`` ([Note: streams]): sample
    ``i`` of each epoch to data-parallel rank ``i % n``; ``set_epoch(epoch)`` on the data set
    before each epoch where it has one; resuming mid-epoch reads the samples the epoch had
    consumed again and skips them. It has no length."""

    def __init__(
        self,
        dataset: IterableDataset,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        step_samples: int,
        remainder: Remainder,
        seed: int,
        device: torch.device | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        if step_samples % (batch_size * world_size):
            raise ValueError(
                f"samples per step ({step_samples}) must be a whole number of batches of "
                f"{batch_size} x {world_size} ranks"
            )
        super().__init__(batch_size, world_size, device)
        self.dataset = dataset
        self.step_samples = step_samples
        self.remainder = remainder
        self._reader = _StreamReader(
            dataset,
            seed=seed,
            collate=collate_fn or default_collate,
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            step_samples=step_samples,
            remainder=remainder,
        )
        # A generator of its own: the DataLoader draws its workers' base seed from it each
        # epoch, which must not move the training process's generator.
        self.loader = DataLoader(
            self._reader,
            batch_size=None,
            collate_fn=_as_is,
            generator=torch.Generator(),
            **loader_kwargs,
        )
        self._start = 0

    def _begin(self) -> Iterator[Any]:
        self._start = self.position * self.batch_size * self.world_size
        self._reader.state.copy_(torch.tensor([self.epoch, self._start, -1]))
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if self.loader.num_workers and callable(set_epoch):  # the script's copy says it too
            set_epoch(self.epoch)
        return iter(self.loader)

    def _ended(self, handed: int) -> None:
        if handed or self._start:
            return
        length = int(self._reader.state[2])
        if length == 0:
            raise ConfigError(
                f"the stream given to engine.loader yielded no samples in epoch {self.epoch}: "
                "an IterableDataset is iterated again each epoch, so it must be one that can "
                "be (not a one-shot generator)"
            )
        if self.remainder == "drop" and length < self.step_samples:
            raise ConfigError(
                f"the stream had {length} samples in epoch {self.epoch}, fewer than one step's "
                f"{self.step_samples} (batch.train_batch_size), and data.remainder = 'drop' "
                "drops them all: use a smaller batch, or data.remainder = 'pad' or 'join'"
            )

    def __len__(self) -> int:
        raise TypeError(
            "a stream (IterableDataset) has no length: engine.loader reads it to its end each "
            "epoch; count steps with engine.global_step instead"
        )


# -- the script's own DataLoader ([Note: your DataLoader]) -----------------------------------


def distributed_sampler(loader: DataLoader) -> DistributedSampler | None:
    """The ``DistributedSampler`` a ``DataLoader`` draws from (directly, or inside its batch
    sampler), or None."""
    for sampler in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def dataloader_problem(
    loader: DataLoader,
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
        self, loader: DataLoader, batch_size: int, device: torch.device | None = None
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


# -- building --------------------------------------------------------------------------------


def _joined_step(leftover: int, world_size: int, micro_batch_size: int) -> str:
    """What ``remainder='join'`` does with an epoch's last ``leftover`` samples, in words."""
    shares = [len(range(r, leftover, world_size)) for r in range(world_size)]
    micro = [-(-k // micro_batch_size) for k in shares]
    return (
        f"the last step's {leftover} samples stay where they fall ({', '.join(map(str, micro))} "
        "micro-batch(es) on ranks "
        f"0..{world_size - 1}); a rank that runs out first shadows the others until all are done"
    )


def _worker_kwargs(
    num_workers: int,
    prefetch_factor: int | None,
    persistent_workers: bool,
    collate_fn: Callable[..., Any] | None,
    device: torch.device | None,
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"num_workers": num_workers}
    if num_workers:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    if collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if device is not None and device.type == "cuda":
        kwargs["pin_memory"] = True
    return kwargs


def make_loader(
    dataset: Dataset,
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


_STREAM_ENDS = {
    "drop": "a last step the stream does not fill is dropped",
    "pad": "a last step the stream does not fill is padded from the stream's beginning",
    "join": "the last step's samples stay on the ranks they fall to; a rank that runs out first "
    "shadows the others until all are done",
}


def make_stream_loader(
    dataset: IterableDataset,
    *,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    train_batch_size: int,
    shuffle: bool | None,
    seed: int,
    remainder: Remainder,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
    collate_fn: Callable[..., Any] | None = None,
    announce: bool = True,
    device: torch.device | None = None,
) -> StreamLoader:
    """Build the loader of a stream ([Note: streams]) and say, once, what it does.
    ``shuffle=True`` is refused: a stream is read in its own order."""
    if shuffle:
        raise ConfigError(
            "engine.loader(stream, shuffle=True): a stream (IterableDataset) is read in its "
            "own order; shuffle it inside the stream with a seed (datasets: "
            "stream.shuffle(seed=..., buffer_size=...), reseeded by set_epoch each epoch)"
        )
    if announce:
        log.info(
            "loader: a stream (%s), sample i to data-parallel rank i %% %d, %d per step (%d per "
            "rank per micro-batch), in its own order (data.shuffle does not apply); "
            "remainder: %s (data.remainder=%r)",
            type(dataset).__name__,
            world_size,
            train_batch_size,
            micro_batch_size,
            _STREAM_ENDS[remainder],
            remainder,
        )
    # The reader collates (in the worker, as a DataLoader does); the DataLoader passes batches on.
    kwargs = _worker_kwargs(num_workers, prefetch_factor, persistent_workers, None, device)
    return StreamLoader(
        dataset,
        rank=rank,
        world_size=world_size,
        batch_size=micro_batch_size,
        step_samples=train_batch_size,
        remainder=remainder,
        seed=seed,
        device=device,
        collate_fn=collate_fn,
        **kwargs,
    )


def build_loader(
    source: Dataset | DataLoader,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    per_step: bool,
    train_batch_size: int,
    data: DataConfig,
    shuffle: bool | None,
    seed: int,
    collate_fn: Callable[..., Any] | None,
    announce: bool,
    device: torch.device | None,
    agree: Callable[[str | None], list[Any]],
) -> Loader:
    """The loader :meth:`Engine.loader` returns for ``source``: a map-style data set's
    (:class:`ShardedLoader`), a stream's (:class:`StreamLoader`), or the script's own
    ``DataLoader`` (:class:`UserLoader`) once ``agree`` (every rank's verdict, in rank order,
    on every rank) says no rank has a problem with it."""
    if isinstance(source, DataLoader):
        why = refusal(
            agree(
                dataloader_problem(
                    source,
                    rank=rank,
                    world_size=world_size,
                    batch_size=batch_size,
                    per_step=per_step,
                    shuffle=shuffle,
                    collate_fn=collate_fn,
                )
            )
        )
        if why is not None:
            raise ConfigError(why)
        if announce:
            log.info(
                "loader: the script's DataLoader with its DistributedSampler (num_replicas=%d): "
                "its batches as they come, set_epoch before each epoch",
                world_size,
            )
        return UserLoader(source, batch_size, device)
    workers = {
        "num_workers": data.num_workers,
        "prefetch_factor": data.prefetch_factor,
        "persistent_workers": data.persistent_workers,
    }
    common = {
        "rank": rank,
        "world_size": world_size,
        "micro_batch_size": batch_size,
        "train_batch_size": train_batch_size,
        "seed": seed,
        "remainder": data.remainder,
        "collate_fn": collate_fn,
        "announce": announce,
        "device": device,
        **workers,
    }
    if isinstance(source, IterableDataset):
        return make_stream_loader(source, shuffle=shuffle, **common)
    return make_loader(source, shuffle=data.shuffle if shuffle is None else shuffle, **common)
