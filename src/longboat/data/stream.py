"""The loader of a stream, an ``IterableDataset``: split by stream position over ranks and by
micro-batch over worker processes, as the map-style loader splits its permutation ([Note: shards]
in ``sharded.py``).

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
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils.data._utils.worker as _torch_worker
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from longboat.config.errors import ConfigError
from longboat.data.loader import Loader, Remainder, _worker_kwargs
from longboat.data.sharded import _seed_all

log = logging.getLogger("longboat")


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


class _StreamReader(IterableDataset[Any]):
    """What each process that loads a rank's batches of a stream iterates: its micro-batches
    ([Note: streams]), read in the training process or in each worker process."""

    def __init__(
        self,
        dataset: IterableDataset[Any],
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
        state = torch.tensor([0, 0, -1], dtype=torch.int64)
        self.state: torch.Tensor = state.share_memory_()  # type: ignore[no-untyped-call]  # torch's is unannotated

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
        dataset: IterableDataset[Any],
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


_STREAM_ENDS = {
    "drop": "a last step the stream does not fill is dropped",
    "pad": "a last step the stream does not fill is padded from the stream's beginning",
    "join": "the last step's samples stay on the ranks they fall to; a rank that runs out first "
    "shadows the others until all are done",
}


def make_stream_loader(
    dataset: IterableDataset[Any],
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
