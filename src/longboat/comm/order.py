"""Launching a sequence of collectives strictly in order, whatever order they become ready in.

[Note: launch order] gloo and NCCL match collectives across ranks by the order each rank issues
them, so two ranks that issued the same buckets in different orders would pair different
buckets (a hang, or wrong sums). A bucket's (or a unit's) gradients may become ready in a
different order on different ranks (a parameter used on one rank only arrives elsewhere never),
so every rank launches them strictly in index order: item k goes once it is ready and every item
before it has gone; whatever is left when backward is over goes then, in order.
"""

from __future__ import annotations

from collections.abc import Callable


class InOrder:
    """Items ``0..count-1`` launched by ``launch(i)`` strictly in index order."""

    def __init__(self, count: int, launch: Callable[[int], None]) -> None:
        self.count = count
        self._launch = launch
        self.next = 0  # the next item to launch

    def reset(self) -> None:
        """Start over (a new backward)."""
        self.next = 0

    def advance(self, ready: Callable[[int], bool], force: bool = False) -> None:
        """Launch every item from the next on while it is ready (all of them with ``force``)."""
        while self.next < self.count and (force or ready(self.next)):
            i = self.next
            self.next += 1  # before launching: a launch may look at what has gone
            self._launch(i)

    def launched(self, i: int) -> bool:
        return i < self.next
