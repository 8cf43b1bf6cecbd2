"""DeepSpeed's ``deepspeed.utils`` names a training script uses: ``RepeatingLoader``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class RepeatingLoader:
    """``loader``'s batches without end: when it runs out, it is iterated again (a new epoch of
    a longboat loader, reshuffled), as DeepSpeed's ``RepeatingLoader``; a loader with no batch
    at all raises ``StopIteration`` rather than looping forever."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)  # an empty loader ends here, as DeepSpeed's does


__all__ = ["RepeatingLoader"]
