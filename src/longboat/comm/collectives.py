"""The one doorway to ``torch.distributed``.

Every collective longboat issues goes through a :class:`Collectives` object, so that logging,
timing, desync checks and hang reports see all traffic in one place. A world of one has no
process group: every operation is then the identity and costs nothing.

Observation is opt-in per doorway and costs one attribute test when off:

* ``desync_check``: before each collective, every rank shares a fingerprint of it
  (:mod:`longboat.comm.desync`); ranks out of step raise :class:`DesyncError` there.
* ``log``: per-operation counts, bytes, times and bandwidths (:mod:`longboat.comm.commlog`).
* a collective that times out, or loses a peer, raises :class:`CollectiveTimeout` /
  :class:`PeerLost` after printing a report naming the ranks that did not arrive
  (:mod:`longboat.comm.hang`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import torch.distributed as dist

from longboat.comm.commlog import CommLog
from longboat.comm.desync import DesyncCheck, DesyncError
from longboat.comm.hang import (
    CollectiveTimeout,
    PeerLost,
    build_report,
    is_hang_or_loss,
    namespace,
    raise_report,
)
from longboat.comm.trace import CallRecord, dtype_name, where_called

__all__ = ["CollectiveTimeout", "Collectives", "DesyncError", "Handle", "PeerLost"]


class Handle(Protocol):
    """An in-flight asynchronous collective."""

    def wait(self) -> Any: ...


class _Done:
    """The handle of an operation that needed no communication."""

    def wait(self) -> bool:
        return True


class _Timed:
    """An in-flight collective whose ``wait`` adds the time it blocks to its doorway's count
    and turns a timeout or a lost peer into a report."""

    __slots__ = ("_log", "_owner", "_rec", "_work")

    def __init__(self, owner: Collectives, work: Any, rec: CallRecord | None,
                 log: tuple[CommLog, int, float] | None = None) -> None:
        self._owner = owner
        self._work = work
        self._rec = rec
        self._log = log  # (log, bytes, launch time) when the work has no future to time it

    def wait(self) -> Any:
        t0 = time.perf_counter()
        try:
            out = self._work.wait()
        except RuntimeError as e:
            self._owner._failed(e, self._rec)
            raise
        finally:
            t1 = time.perf_counter()
            self._owner.blocked_seconds += t1 - t0
        if self._log is not None and self._rec is not None:
            log, nbytes, launched = self._log
            log.add(self._rec, nbytes, t1 - launched)
            self._log = None
        return out


# torch 2.13 renamed the tensor forms and deprecated the old names; torch>=2.4 has the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Collectives:
    """Collectives over one process group (the default group when ``group`` is None).

    ``timeout_s`` is the desync check's group timeout (the default group's own timeout is set
    where it is created, :func:`longboat.world.init_process_group`). Creating a doorway with
    ``desync_check`` is itself collective: every rank of the group must create it.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, desync_check: bool = False,
                 log: bool = False, log_verbose: bool = False, timeout_s: float = 600.0) -> None:
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        if self.world_size == 1:
            self.active = False
        self.timeout_s = timeout_s
        # Wall time this rank spent blocked in collectives: inside synchronous calls and in
        # waits on asynchronous ones (the profiler's "waiting for communication").
        self.blocked_seconds = 0.0
        self.seq = 0  # collectives issued; the same on every rank while they are in step
        self.last: CallRecord | None = None  # the last collective that completed its issue
        self._check = (DesyncCheck(self.rank, self.world_size, timeout_s, group)
                       if desync_check and self.active else None)
        self.commlog = CommLog(self.world_size, self.rank, log_verbose) if log else None
        self.desync_check = self._check is not None
        self.log = self.commlog is not None
        self._group_name = "default" if group is None else str(getattr(group, "group_name", "?"))

    # -- observation ---------------------------------------------------------------------------

    @property
    def observing(self) -> bool:
        return self.desync_check or self.log

    def log_summary(self) -> list[dict[str, Any]]:
        """The comm log's rows (see :meth:`CommLog.summary`); empty when the log is off."""
        return self.commlog.summary() if self.commlog is not None else []

    def close(self) -> None:
        """Release the desync check's group (every rank calls it, like the constructor)."""
        if self._check is not None and dist.is_initialized():
            dist.destroy_process_group(self._check.group)
        self._check = None
        self.desync_check = False

    def _record(self, op: str, tensor: torch.Tensor | None, out: torch.Tensor | None,
                reduce_op: str, tag: str) -> CallRecord:
        source, caller = where_called(3)
        return CallRecord(
            seq=self.seq, op=op, dtype=dtype_name(tensor.dtype) if tensor is not None else "-",
            shape=tuple(tensor.shape) if tensor is not None else (),
            out_shape=tuple(out.shape) if out is not None else None, reduce_op=reduce_op,
            group=self._group_name, source=source, caller=caller, tag=tag)

    def _failed(self, err: RuntimeError, rec: CallRecord | None) -> None:
        """A collective raised: timeouts and lost peers become a report and its exception."""
        if isinstance(err, (DesyncError, CollectiveTimeout, PeerLost)) or not is_hang_or_loss(err):
            return
        peer_last = self._check.last_agreed if self._check is not None else None
        rep = build_report(rank=self.rank, world_size=self.world_size,
                           namespace=namespace(self._group_name), current=rec,
                           last_done=self.last, peer_last=peer_last, error=err,
                           timeout_s=self.timeout_s)
        raise_report(rep, err)

    # -- issuing -------------------------------------------------------------------------------

    def _issue(self, fn: Any, *args: Any, async_op: bool, **kwargs: Any) -> Handle:
        t0 = time.perf_counter()
        try:
            work = fn(*args, group=self.group, async_op=async_op, **kwargs)
        except RuntimeError as e:
            self._failed(e, None)
            raise
        if async_op:
            return _Timed(self, work, None)
        self.blocked_seconds += time.perf_counter() - t0
        return _Done()

    def _observed(self, name: str, fn: Any, *args: Any, tensor: torch.Tensor | None,
                  out: torch.Tensor | None = None, reduce_op: str = "", check_src: int = -1,
                  nbytes: int = 0, tag: str = "", async_op: bool, **kwargs: Any) -> Handle:
        """``_issue`` with the desync check, the record and the comm log."""
        rec = self._record(name, tensor, out, reduce_op, tag)
        t0 = time.perf_counter()
        try:
            if self.desync_check and self._check is not None:
                self._check.exchange(rec, check_src)
            t1 = time.perf_counter()
            work = fn(*args, group=self.group, async_op=async_op, **kwargs)
        except RuntimeError as e:
            self.blocked_seconds += time.perf_counter() - t0
            self._failed(e, rec)
            raise
        self.last = rec
        log = self.commlog if self.log else None
        if async_op:
            self.blocked_seconds += t1 - t0
            if log is not None:
                try:
                    fut = work.get_future()
                except RuntimeError:  # e.g. gloo's reduce_scatter: timed to the end of wait()
                    return _Timed(self, work, rec, (log, nbytes, t1))
                fut.add_done_callback(lambda _f: log.add(rec, nbytes, time.perf_counter() - t1))
            return _Timed(self, work, rec)
        t2 = time.perf_counter()
        self.blocked_seconds += t2 - t0
        if log is not None:
            log.add(rec, nbytes, t2 - t1)
        return _Done()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False
                   ) -> Handle:
        """Reduce ``tensor`` in place across ranks (``op``: sum, max or min)."""
        if not self.active:
            return _Done()
        self.seq += 1
        if self.observing:
            return self._observed("all_reduce", dist.all_reduce, tensor, op=_OPS[op],
                                  tensor=tensor, reduce_op=op, async_op=async_op,
                                  nbytes=tensor.numel() * tensor.element_size())
        return self._issue(dist.all_reduce, tensor, op=_OPS[op], async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                       tag: str = "") -> Handle:
        """Sum ``input`` across ranks; rank r keeps chunk r of the result in ``output``.
        ``tag`` says what the tensor is, for the desync check and reports."""
        if not self.active:
            output.copy_(input)
            return _Done()
        self.seq += 1
        if self.observing:
            return self._observed("reduce_scatter", _reduce_scatter, output, input,
                                  op=dist.ReduceOp.SUM, tensor=input, out=output,
                                  reduce_op="sum", async_op=async_op, tag=tag,
                                  nbytes=input.numel() * input.element_size())
        return self._issue(_reduce_scatter, output, input, op=dist.ReduceOp.SUM,
                           async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   tag: str = "") -> Handle:
        """Concatenate every rank's ``input`` (equal sizes, in rank order) into ``output``.
        ``tag`` says what the tensor is, for the desync check and reports."""
        if not self.active:
            output.copy_(input)
            return _Done()
        self.seq += 1
        if self.observing:
            return self._observed("all_gather", _all_gather, output, input, tensor=input,
                                  out=output, async_op=async_op, tag=tag,
                                  nbytes=output.numel() * output.element_size())
        return self._issue(_all_gather, output, input, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
        if not self.active:
            return
        self.seq += 1
        if self.observing:
            self._observed("broadcast", dist.broadcast, tensor, src=src, tensor=tensor,
                           check_src=src, async_op=False,
                           nbytes=tensor.numel() * tensor.element_size())
        else:
            self._issue(dist.broadcast, tensor, src=src, async_op=False)

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        if not self.active:
            return
        self.seq += 1
        if self.observing:
            self._observed("barrier", dist.barrier, tensor=None, async_op=False)
        else:
            self._issue(dist.barrier, async_op=False)
