"""What every loader :meth:`Engine.loader` returns shares: the epoch, the position in it (what a
checkpoint records), the fetch timing and the copy to the rank's device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

_NULL = contextlib.nullcontext()
_END = object()
Remainder = Literal["drop", "pad", "join"]


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
        self.position = 0  # batches handed out so far in this epoch (since _offset)
        self._skip = 0  # batches to skip at the next iteration (set by load_state_dict)
        # Samples of the epoch consumed before ``position`` began counting: 0, unless the
        # world changed mid-epoch ([Note: regrouped loader]).
        self._offset = 0
        # (epoch, samples) to continue from at the next batch: set by regroup().
        self._restart: tuple[int, int] | None = None
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
        device = None if self.device is None or self.device.type == "cpu" else self.device
        try:
            while True:
                if self._restart is not None:  # [Note: regrouped loader]
                    (epoch, samples), self._restart = self._restart, None
                    assert epoch == self.epoch, (epoch, self.epoch)
                    self._end()
                    self._offset, self.position, first = samples, 0, 0
                    it = self._begin()
                # The profiler times the fetch (and the copy to the device) as data loading.
                with self.on_fetch() if self.on_fetch is not None else _NULL:
                    batch = next(it, _END)
                    if batch is _END:
                        break
                    if device is not None:
                        batch = to_device(batch, device)
                self.position += 1
                yield batch
        finally:
            self._end()
        self._ended(self.position - first)
        self.epoch += 1
        self.position = 0
        self._offset = 0

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as JSON-ready values."""
        return {"epoch": self.epoch, "samples": self.samples}

    @property
    def samples(self) -> int:
        """Samples of the current epoch handed out so far, over every data-parallel rank."""
        return self._offset + self.position * self.batch_size * self.world_size

    def where(self) -> tuple[int, int]:
        """(epoch, samples) this loader's next batch starts from: an epoch that has handed out
        all its batches counts as the next one's start ([Note: regrouped loader])."""
        raise NotImplementedError(
            f"a {type(self).__name__} cannot be re-sharded over a new set of ranks (in-job "
            "recovery): use a map-style data set with engine.loader"
        )

    def regroup(self, rank: int, world_size: int, epoch: int, samples: int) -> None:
        """Continue at the next batch from ``samples`` into ``epoch``, as rank ``rank`` of
        ``world_size`` data-parallel ranks ([Note: regrouped loader])."""
        self.where()  # says which loaders cannot

    def place(self, epoch: int, samples: int) -> None:
        """Before its first iteration: begin at ``samples`` into ``epoch`` (a replacement's
        loader, where the others' stand, [Note: regrouped loader])."""
        self.where()  # says which loaders cannot

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
        self._offset = 0


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
