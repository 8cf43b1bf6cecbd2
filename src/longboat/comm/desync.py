"""The desync check: before each collective every rank shares a small fingerprint of it.

The fingerprints travel on a separate gloo group (so the check works under NCCL as well), and
every rank sees every rank's fingerprint, so every rank detects a mismatch at the same collective
and raises :class:`DesyncError` there, instead of hanging or computing garbage.
"""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.trace import (
    FINGERPRINT_LEN,
    LONE_FORWARD,
    CallRecord,
    describe_fingerprint,
    fingerprint,
)

# Bytes of each rank's description exchanged once a mismatch is found.
_DESCRIPTION_BYTES = 512


class DesyncError(RuntimeError):
    """Ranks entered different collectives, or the same one with different shapes or dtypes."""


@dataclass
class PendingCheck:
    """A fingerprint exchange in flight (an asynchronous collective's check)."""

    work: Any
    table: torch.Tensor  # every rank's fingerprint, once the exchange lands
    mine: torch.Tensor  # kept alive until then
    rec: CallRecord


class DesyncCheck:
    """Fingerprint exchange over a dedicated gloo group (created collectively at setup)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        group: dist.ProcessGroup | None,
        check_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._timeout = datetime.timedelta(seconds=timeout_s)
        if check_group is None:  # a gloo group of the same ranks, made here (collectively)
            ranks = None if group is None else dist.get_process_group_ranks(group)
            check_group = dist.new_group(
                ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        self.group = check_group
        self._mine = torch.zeros(FINGERPRINT_LEN, dtype=torch.int64)
        self._all = torch.zeros(world_size, FINGERPRINT_LEN, dtype=torch.int64)
        self._views = list(self._all.unbind(0))
        # Every rank's fingerprint at the last exchange that agreed (what the hang report
        # knows of a peer that stops answering).
        self.last_agreed: CallRecord | None = None

    def exchange(self, rec: CallRecord, src: int) -> None:
        """Share ``rec``'s fingerprint; raise :class:`DesyncError` on every rank if they differ.

        A peer that stops or dies makes this raise the backend's error (timeout, closed
        connection); the doorway turns that into a hang report.
        """
        self._mine.copy_(torch.tensor(fingerprint(rec, src), dtype=torch.int64))
        dist.all_gather(self._views, self._mine, group=self.group)
        if bool((self._all == self._all[0]).all()):
            self.last_agreed = rec
            return
        raise DesyncError(self._explain(rec))

    def start(self, rec: CallRecord, src: int) -> PendingCheck:
        """Share ``rec``'s fingerprint without waiting (an asynchronous collective's check):
        :meth:`finish` verifies it, before anyone uses the collective's result."""
        mine = torch.tensor(fingerprint(rec, src), dtype=torch.int64)
        table = torch.empty(self.world_size, FINGERPRINT_LEN, dtype=torch.int64)
        work = dist.all_gather(list(table.unbind(0)), mine, group=self.group, async_op=True)
        return PendingCheck(work, table, mine, rec)

    def finish(self, pending: PendingCheck) -> None:
        """Wait for a :meth:`start`-ed exchange; raise :class:`DesyncError` on a mismatch.

        Every rank checks the same exchange, so every rank raises at the same collective. The
        peers' words come from their fingerprints (no further collective: other checks may
        already be in flight behind this one)."""
        pending.work.wait(self._timeout)  # bounded, as Collectives' own waits (see _Timed)
        table = pending.table
        if bool((table == table[0]).all()):
            if self.last_agreed is None or pending.rec.seq > self.last_agreed.seq:
                self.last_agreed = pending.rec
            return
        prints = [tuple(row.tolist()) for row in table]
        words = [describe_fingerprint(fp) for fp in prints]
        words[self.rank] = pending.rec.describe()
        raise DesyncError(self._compose(pending.rec, prints, words))

    def _descriptions(self, rec: CallRecord) -> list[str]:
        """Every rank's own words for the collective it entered (only after a mismatch)."""
        text = rec.describe().encode()[:_DESCRIPTION_BYTES]
        mine = torch.zeros(_DESCRIPTION_BYTES, dtype=torch.uint8)
        mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in out]

    def _explain(self, rec: CallRecord) -> str:
        words = self._descriptions(rec)
        prints = [tuple(row.tolist()) for row in self._all]
        return self._compose(rec, prints, words)

    def _speaker(self, ranks: list[int]) -> int:
        """Whose words describe a group of agreeing ranks: this rank's own if it is one of
        them (its description is the fullest), else the first's."""
        return self.rank if self.rank in ranks else ranks[0]

    def _compose(self, rec: CallRecord, prints: list[tuple[int, ...]], words: list[str]) -> str:
        # The largest group of agreeing ranks is taken as the expected behaviour (ties: the
        # group of the lowest rank); every other group is named against it.
        counts = Counter(prints)
        best = max(counts.values())
        ref_print = next(p for p in prints if counts[p] == best)
        ref_ranks = [r for r, p in enumerate(prints) if p == ref_print]
        lone = [r for r, p in enumerate(prints) if p[12]]  # [Note: lone forwards]
        lines = []
        for fp in dict.fromkeys(prints):
            if fp == ref_print:
                continue
            ranks = [r for r, p in enumerate(prints) if p == fp]
            why = _lone(lone) if fp[12] or ref_print[12] else _difference(fp, ref_print)
            lines.append(
                f"{_ranks(ranks)} entered {_strip_seq(words[self._speaker(ranks)])} where "
                f"{_ranks(ref_ranks)} entered {_strip_seq(words[self._speaker(ref_ranks)])}; "
                f"{why}"
            )
        head = (
            f"collectives out of step at collective #{rec.seq} (seen by rank {self.rank} "
            f"of {self.world_size}): "
        )
        return head + "\n  ".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _strip_seq(description: str) -> str:
    sig, _, rest = description.partition(" #")
    _, _, where = rest.partition(" ")
    return f"{sig} {where}".strip()


def _lone(ranks: list[int]) -> str:
    """Why a collective of a forward outside training met another: the others did not run that
    forward ([Note: lone forwards] in ``trace.py``), whatever else differs."""
    return (
        f"{_ranks(ranks)} issued it {LONE_FORWARD} (under torch.no_grad() or in eval mode) that "
        "the other ranks did not run alike: under ZeRO-3 a unit's module gathers its "
        "parameters from every rank in its forward, so a forward on some ranks only (an "
        "evaluation on rank 0) must run inside `with engine.gathered_parameters():`, entered "
        "on every rank, e.g. `with engine.gathered_parameters():` then `if rank == 0: "
        "engine(x)`"
    )


def _difference(a: tuple[int, ...], b: tuple[int, ...]) -> str:
    """Which field of two fingerprints differs, and what that usually means."""
    if a[1] != b[1]:
        return "different operations: a rank skipped or added a collective"
    if a[2] != b[2]:
        return "different reduce operations"
    if a[3] != b[3]:
        return "different dtypes: cast the tensor to the same dtype on every rank"
    if a[4:10] != b[4:10]:
        return "different shapes: every rank must pass tensors of the same shape"
    if a[10] != b[10]:
        return "different source ranks for the broadcast"
    if a[11] != b[11]:
        return (
            "different tensors of the same shape (see the tags): ranks reached this "
            "collective from different places, e.g. a ZeRO-3 unit whose module ran on some "
            "ranks only; every rank must run the same units in the same order, so put a "
            "module that runs conditionally (a routed expert) inside a unit that always runs "
            "(name the enclosing module's class in zero.unit_classes)"
        )
    return "different collective counts: a rank issued a collective outside this doorway"
