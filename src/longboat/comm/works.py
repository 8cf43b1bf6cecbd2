"""Handles of operations in flight or over, as a :class:`~longboat.comm.collectives.Collectives`
doorway gives them back: timed into its count, checked ([Note: overlapped check]) and
reported (a timeout or a lost peer) when waited; and the reduce-scatter gloo does without its
copy of the input ([Note: gloo reduce-scatter]). Below every other module of ``comm/``: what
it is given (records, logs, checks, its doorway's waits under an alarm) it only passes on."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class Done:
    """The handle of an operation that is already over: no communication was needed, or it
    blocked until done."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Timed:
    """An in-flight collective whose ``wait`` adds the time it blocks to its doorway's count
    and turns a timeout or a lost peer into a report."""

    __slots__ = ("_check", "_log", "_loss_reported", "_owner", "_rec", "_work")

    def __init__(
        self,
        owner: Any,  # the Collectives doorway that issued it
        work: Any,
        rec: Any,  # its CallRecord (comm/trace.py), None when not observed
        log: tuple[Any, int, float] | None = None,  # (CommLog, bytes, launch time)
        check: Any = None,  # a PendingCheck (comm/desync.py)
        loss_reported: bool = True,
    ) -> None:
        self._owner = owner
        # False: a lost peer is the caller's to name ([Note: receives from any rank])
        self._loss_reported = loss_reported
        self._work = work
        self._rec = rec
        self._log = log  # (log, bytes, launch time) when the work has no future to time it
        self._check = check  # [Note: overlapped check]: verified before the result is used

    def is_completed(self) -> bool:
        """Whether the operation is over (without waiting for it)."""
        return bool(self._work.is_completed())

    def wait(self) -> Any:
        t0 = time.perf_counter()
        try:
            watched = self._owner.alarm is not None
            if self._check is not None:
                check, self._check = self._check, None
                assert self._owner._check is not None
                if watched:  # the exchange is a collective too ([Note: watched waits])
                    self._owner._wait_watched(check.work)
                self._owner._check.finish(check)  # raises DesyncError on every rank alike
            # Bounded: measured with a host's link cut mid-run, a gloo work could wait forever
            # on the side that was cut off while the other side's timed out as configured.
            if not watched:
                out = self._work.wait(self._owner.wait_timeout)
            else:  # [Note: watched waits], asked of the doorway: it holds the alarm
                out = self._owner._wait_watched(self._work)
        except RuntimeError as e:
            self._owner._failed(e, self._rec, self._loss_reported)
            raise
        finally:
            t1 = time.perf_counter()
            self._owner.blocked_seconds += t1 - t0
        if self._log is not None and self._rec is not None:
            log, nbytes, launched = self._log
            log.add(self._rec, nbytes, t1 - launched)
            self._log = None
        return out


# [Note: gloo reduce-scatter] gloo has no reduce-scatter of its own: torch's ProcessGroupGloo
# clones the input, all-reduces the clone and, in ``wait``, copies this rank's chunk into the
# output, so a full-size copy of every reduction in flight is alive until its wait. ZeRO's input
# is a transient gradient buffer that is dropped once its shard landed; told so (``scratch``),
# the doorway all-reduces that buffer itself, in place, and copies the chunk in ``wait``: the
# same bytes on the wire and the same sums, without the clone.


class ThenOnce:
    """The work of an operation whose ``wait`` ends with a step of this rank's own, taken once
    the work is over ([Note: gloo reduce-scatter], [Note: gloo reduce-scatter of two])."""

    __slots__ = ("_done", "_then", "_work")

    def __init__(self, work: Any, then: Callable[[], object]) -> None:
        self._work, self._then, self._done = work, then, False

    def get_future(self) -> Any:
        return self._work.get_future()

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        out = self._work.wait(timeout) if timeout is not None else self._work.wait()
        if not self._done:
            self._done = True
            self._then()
        return bool(out) if out is not None else True


def reduce_scatter_in_place(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> Any:
    """A reduce-scatter as gloo does it, without its copy of ``input`` ([Note: gloo
    reduce-scatter]): ``input`` is all-reduced in place and left holding the sum."""
    work = dist.all_reduce(input, op=op, group=group, async_op=True)
    mine = input.chunk(dist.get_world_size(group))[dist.get_rank(group)]
    chunk = ThenOnce(work, lambda: output.copy_(mine))
    if async_op:
        return chunk
    chunk.wait()
    return None


# [Note: gloo all-gather of two] gloo's all-gather is slow: at two ranks on 2 CPU cores over
# loopback, gathering a 12.6 MB unit took 4.96 ms and a 201 MB one 152 ms, where an all-to-all
# moving the same bytes took 3.19 and 47.6 ms (``benchmarks/results/gloo_two_ranks.json``). At two
# ranks an all-gather *is* an all-to-all in which each rank sends its shard to the other and
# receives the other's into that rank's chunk of the output (of any shape: chunks of its
# flattened view, as gathering along the first dimension lays them out): both are contiguous, so
# nothing is staged, and this rank's own chunk is a local copy. At more ranks the same exchange
# would need the shard repeated once per peer in one buffer (an all-to-all takes one contiguous
# input), a unit-sized copy per gather in flight, so gloo's own all-gather stays there.


def all_gather_of_two(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool
) -> Any:
    """An all-gather over a group of two as an all-to-all ([Note: gloo all-gather of two])."""
    rank, n = dist.get_rank(group), input.numel()
    peer = 1 - rank
    flat = output.view(-1)  # the doorway passes contiguous tensors of any shape
    flat[rank * n : (rank + 1) * n].copy_(input.view(-1))
    splits = [0, 0]
    splits[peer] = n
    return dist.all_to_all_single(
        flat[peer * n : (peer + 1) * n],
        input.view(-1),
        output_split_sizes=splits,
        input_split_sizes=splits,
        group=group,
        async_op=async_op,
    )


# [Note: gloo reduce-scatter of two] At two ranks a reduce-scatter needs no all-reduce: each rank
# sends the other the other's chunk of its input and receives the other's copy of its own chunk
# into the output, to which ``wait`` adds its own chunk (an all-to-all with the splits of [Note:
# gloo all-gather of two]): half the bytes of gloo's all-reduce, no staging copy, the input left
# as it was. The sum is the same to the bit: at two ranks it is one addition, and float addition
# commutes. Measured (``benchmarks/results/gloo_two_ranks.json``): a 12.6 MB input in 4.08 ms
# against 8.86 for the in-place all-reduce (gloo's own reduce-scatter: 8.49), 201 MB in 49.5
# against 113.9 (204.1).


def reduce_scatter_of_two(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any,
    group: dist.ProcessGroup | None,
    async_op: bool,
) -> Any:
    """A sum reduce-scatter over a group of two as an all-to-all ([Note: gloo reduce-scatter of
    two])."""
    rank, n = dist.get_rank(group), output.numel()
    peer = 1 - rank
    flat, out = input.view(-1), output.view(-1)
    splits = [0, 0]
    splits[peer] = n
    work = dist.all_to_all_single(
        out,
        flat[peer * n : (peer + 1) * n],
        output_split_sizes=splits,
        input_split_sizes=splits,
        group=group,
        async_op=True,
    )
    own = flat[rank * n : (rank + 1) * n]
    done = ThenOnce(work, lambda: out.add_(own))
    if async_op:
        return done
    done.wait()
    return None
