"""A joined ZeRO-3 rank's part in the others' micro-batch: their collectives, replayed.

[Note: stage-3 shadow] A rank without a batch for a micro-batch ([Note: joining] in ``join.py``)
must still take part in stage 3's gathers, forward and backward, and in the reduce-scatters
between them, in the order the others issue them. Two ways were open: run a forward and backward
on no data (an empty or remembered batch), or replay the collectives without compute. The
replay is the simpler correct one: an empty batch breaks layers such as BatchNorm, a remembered
one costs a whole forward and backward, and either would mark parameters used and move the
joined rank's buffers. So every real micro-batch records, in issue order, the gathers and
reduce-scatters it put on the shard group (from ``before_forward`` to the reductions
``after_backward`` launches), and a shadow replays its rank's last record: each gather
synchronously (gathered, then freed at once), each reduce-scatter through the in-order launcher
with the zeros of a unit that received no gradient. That is exactly the others' sequence because
those events are the ones every rank sees alike ([Note: stage-3 order] in ``strategy.py``) and
every rank runs the same units in the same order on each micro-batch; a model whose units change
from one micro-batch to the next would replay the wrong ones, and the desync check names the
units then. A rank that runs out before its first micro-batch has nothing to replay and says so.
"""

from __future__ import annotations

from longboat.comm.order import InOrder
from longboat.strategies.zero.flat import FlatUnit
from longboat.strategies.zero.gather import Gathering

Event = tuple[str, int]  # ("gather" or "reduce", unit index)


class Shadow:
    """This micro-batch's gathers and reductions, in issue order, and the last real
    micro-batch's, which a shadow replays (stage 3; ``active`` is False for stages 1-2, whose
    shadow needs no record)."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.schedule: list[Event] = []
        self.last: list[Event] | None = None

    def record(self, event: Event) -> None:
        if self.active:
            self.schedule.append(event)

    def start(self) -> None:
        """A new micro-batch's record."""
        self.schedule.clear()

    def keep(self) -> None:
        """A real micro-batch's backward is over: its record is the one to replay."""
        if self.active:
            self.last = list(self.schedule)

    def replay(
        self, units: list[FlatUnit], gathering: Gathering, order: InOrder, rank: int
    ) -> None:
        """The last real micro-batch's gathers and reductions, as the others issue them now."""
        if self.last is None:
            raise RuntimeError(
                f"zero-3: data-parallel rank {rank} ran out of batches before its first "
                "micro-batch, so it has no record of the units' gathers to replay while the "
                "others train ([Note: stage-3 shadow]); give every rank at least one micro-batch"
            )
        self.schedule.clear()
        for kind, index in self.last:
            if kind == "gather":
                u = units[index]
                gathering.free(u)  # (every unit is sharded between micro-batches)
                gathering.ready(u)
                gathering.free(u)
            else:  # the reductions go in unit order: this launches exactly unit ``index``

                def through(i: int, last: int = index) -> bool:
                    return i <= last

                order.advance(through)
