"""The one doorway to ``torch.distributed``.

Every collective longboat issues goes through a :class:`Collectives` object, so that logging,
timing, desync checks and hang reports see all traffic in one place; point-to-point (the
pipeline's sends, the parameter server's messages) goes through it too
(:mod:`longboat.comm.messages`). A world of one has no process group: every operation is then
the identity and costs nothing.

Observation is opt-in per doorway and costs one attribute test when off:

* ``desync_check``: before each collective, every rank shares a fingerprint of it
  (:mod:`longboat.comm.desync`); ranks out of step raise :class:`DesyncError` there.

[Note: overlapped check] A synchronous collective waits for the fingerprint exchange before it
is issued. An asynchronous one on NCCL does not: its exchange is started, the collective issued
at once, the fingerprints verified in the handle's ``wait``, before anything uses the result, so
the buckets and ZeRO's reductions and gathers pay no round trip on their critical path. On gloo
every collective waits for its exchange: gloo's transport aborts the process (uncatchable
``gloo::EnforceNotMet`` in its own thread) when a peer sends more bytes than this rank's op
expects, as ranks out of step with different sizes do within milliseconds (ZeRO-3 units gathered
out of step on two CPU ranks killed a rank in 2 runs of 6 with the overlap, none without).
* ``log``: per-operation counts, bytes, times and bandwidths (:mod:`longboat.comm.commlog`).
* a collective that times out, or loses a peer, raises :class:`CollectiveTimeout` /
  :class:`PeerLost` after printing a report naming the ranks that did not arrive
  (:mod:`longboat.comm.hang`).

A doorway speaks in group ranks: ``rank`` is this process's position in the group, and the
``src`` of a broadcast or the peer of a ``send``/``recv`` is a position in the group too.

[Note: NCCL rules] NCCL accepts only tensors on the GPU, so on a GPU job a tensor made on the CPU
(a flag, a JSON exchange) must not go through a data-plane doorway, and anything the CPU must
read (fingerprints, flags, JSON) goes through a control-plane doorway on a gloo group instead
(:mod:`longboat.topology`). gloo accepts both, so a CPU test would not notice a mistake; a doorway
given :class:`Rules` refuses what NCCL (for the data plane) or the control plane's purpose would
refuse: the data plane any tensor not on the model's device, the control plane anything but
small CPU tensors. ``LONGBOAT_NCCL_RULES=1`` turns the rules on for every doorway a topology
builds (the test suite runs under it).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.commlog import CommLog
from longboat.comm.desync import DesyncCheck, DesyncError
from longboat.comm.errors import CollectiveTimeout, PeerLost
from longboat.comm.hang import (
    build_report,
    is_hang_or_loss,
    is_timeout,
    namespace,
    raise_report,
)
from longboat.comm.messages import PointToPoint
from longboat.comm.protocol import Comm, Handle, Mailbox
from longboat.comm.rules import NCCL_RULES_VAR, Rules, RulesError
from longboat.comm.trace import CallRecord, dtype_name, where_called
from longboat.comm.watched import Alarm, wait_watched
from longboat.comm.works import (
    Done,
    Timed,
    all_gather_of_two,
    reduce_scatter_in_place,
    reduce_scatter_of_two,
)

__all__ = [
    "NCCL_RULES_VAR",
    "CollectiveTimeout",
    "Collectives",
    "Comm",
    "DesyncError",
    "Handle",
    "Mailbox",
    "PeerLost",
    "Rules",
    "RulesError",
]

# torch 2.13 renamed the tensor forms and deprecated the old names; torch>=2.4 has the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Collectives(PointToPoint):
    """Collectives over one process group (the default group when ``group`` is None); implements
    :class:`~longboat.comm.protocol.Comm`.

    ``check_group`` is the gloo group (same ranks) the desync check exchanges fingerprints on;
    with ``desync_check`` and no ``check_group`` the doorway creates one, which is itself
    collective: every rank of the group must then create the doorway. ``timeout_s`` is that
    group's timeout (the data group's own timeout is set where it is created).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        desync_check: bool = False,
        log: bool = False,
        log_verbose: bool = False,
        timeout_s: float = 600.0,
        check_group: dist.ProcessGroup | None = None,
        rules: Rules | None = None,
        name: str | None = None,
    ) -> None:
        self.group = group
        self._closed = False
        self.active = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        if self.world_size == 1:
            self.active = False
        self.timeout_s = timeout_s
        self.wait_timeout = datetime.timedelta(seconds=timeout_s)  # every wait is bounded by it
        self.rules = rules
        # Wall time this rank spent blocked in collectives: inside synchronous calls and in
        # waits on asynchronous ones (the profiler's "waiting for communication").
        self.blocked_seconds = 0.0
        self.seq = 0  # collectives issued; the same on every rank while they are in step
        self.last: CallRecord | None = None  # the last collective that completed its issue
        self._owns_check_group = desync_check and self.active and check_group is None
        self._check = (
            DesyncCheck(self.rank, self.world_size, timeout_s, group, check_group)
            if desync_check and self.active
            else None
        )
        self.commlog = CommLog(self.world_size, self.rank, log_verbose) if log else None
        self.desync_check = self._check is not None
        self.log = self.commlog is not None
        self._group_name = name or (
            "default" if group is None else str(getattr(group, "group_name", "?"))
        )
        self._global = (
            dist.get_process_group_ranks(group) if self.active and group is not None else None
        )
        self._gloo: bool | None = None  # the group's backend is gloo: asked at first need
        # Set under in-job recovery: why this group is known to have failed, or None; every
        # wait, synchronous calls included, then asks it ([Note: watched waits] in watched.py)
        self.alarm: Alarm | None = None

    @classmethod
    def alone(cls, global_rank: int = 0, name: str = "alone") -> Collectives:
        """A doorway for a group of one rank, this process (global rank ``global_rank``): every
        operation is the identity, whatever the default group is."""
        solo = cls(name=name)
        solo.active, solo.world_size, solo.rank = False, 1, 0
        solo._global = [global_rank]
        return solo

    def global_rank(self, group_rank: int) -> int:
        if self._global is not None:
            return self._global[group_rank]
        if self.active or group_rank == 0:
            return group_rank  # the default group: group ranks are global ranks
        raise ValueError(f"group rank {group_rank} in a group of one")

    # -- observation ---------------------------------------------------------------------------

    @property
    def observing(self) -> bool:
        return self.desync_check or self.log

    def log_summary(self) -> list[dict[str, Any]]:
        """The comm log's rows (see :meth:`CommLog.summary`); empty when the log is off."""
        return self.commlog.summary() if self.commlog is not None else []

    def close(self) -> None:
        """Release the desync check's group if the doorway made it (every rank calls it, like
        the constructor), and let go of the process group.

        [Note: teardown] ``dist.destroy_process_group`` unregisters a group, but a gloo group's
        worker threads live until the last Python reference to it is gone. A worker that
        finishes a collective drops the tensors it holds a moment after ``wait`` returned; if
        that moment falls during interpreter shutdown, freeing a tensor whose Python object has
        already been released takes the GIL there and aborts the process ("terminate called
        without an active exception", rank killed by SIGABRT after a finished run). Dropping
        every reference at close joins those threads while the interpreter is alive."""
        if self._check is not None and self._owns_check_group and dist.is_initialized():
            dist.destroy_process_group(self._check.group)
        if self._check is not None:
            self._check.group = None
        self._check = None
        self.desync_check = False
        self.group = None
        self._closed = True

    def _live(self) -> dist.ProcessGroup | None:
        """The group to issue on; refused once the doorway is closed (a closed engine)."""
        if self._closed:
            raise RuntimeError(
                f"the collectives doorway '{self._group_name}' is closed (engine.close() was "
                "called): build a new engine to communicate again"
            )
        return self.group

    def _record(
        self,
        op: str,
        tensor: torch.Tensor | None,
        out: torch.Tensor | None,
        reduce_op: str,
        tag: str,
    ) -> CallRecord:
        source, caller = where_called(3)
        return CallRecord(
            seq=self.seq,
            op=op,
            dtype=dtype_name(tensor.dtype) if tensor is not None else "-",
            shape=tuple(tensor.shape) if tensor is not None else (),
            out_shape=tuple(out.shape) if out is not None else None,
            reduce_op=reduce_op,
            group=self._group_name,
            source=source,
            caller=caller,
            tag=tag,
        )

    def _failed(
        self, err: RuntimeError, rec: CallRecord | None, loss_reported: bool = True
    ) -> None:
        """An operation raised: timeouts and lost peers become a report and its exception
        (a lost peer only if ``loss_reported``: [Note: receives from any rank])."""
        if isinstance(err, (DesyncError, CollectiveTimeout, PeerLost)) or not is_hang_or_loss(err):
            return
        if not loss_reported and not is_timeout(err):
            return
        peer_last = self._check.last_agreed if self._check is not None else None
        rep = build_report(
            rank=self.rank,
            world_size=self.world_size,
            namespace=namespace(self._group_name),
            current=rec,
            last_done=self.last,
            peer_last=peer_last,
            error=err,
            timeout_s=self.timeout_s,
        )
        raise_report(rep, err)

    def _wait_watched(self, work: Any) -> Any:
        """Wait for ``work`` as a synchronous call would, asking the alarm ([Note: watched
        waits] in ``comm/watched.py``); what ``work.wait`` gives."""
        assert self.alarm is not None
        what = f"a collective of group '{self._group_name}'"
        return wait_watched(work, self.wait_timeout, self.alarm, what)

    # -- issuing -------------------------------------------------------------------------------

    def _issue(self, fn: Any, *args: Any, async_op: bool, **kwargs: Any) -> Handle:
        t0 = time.perf_counter()
        watched = self.alarm is not None and not async_op  # issued async, waited watched
        try:
            work = fn(*args, group=self._live(), async_op=async_op or watched, **kwargs)
            if watched:
                self._wait_watched(work)
        except RuntimeError as e:
            self._failed(e, None)
            raise
        if async_op:
            return Timed(self, work, None)
        self.blocked_seconds += time.perf_counter() - t0
        return Done()

    def _observed(
        self,
        name: str,
        fn: Any,
        *args: Any,
        tensor: torch.Tensor | None,
        out: torch.Tensor | None = None,
        reduce_op: str = "",
        check_src: int = -1,
        nbytes: int = 0,
        tag: str = "",
        async_op: bool,
        **kwargs: Any,
    ) -> Handle:
        """``_issue`` with the desync check, the record and the comm log."""
        rec = self._record(name, tensor, out, reduce_op, tag)
        t0 = time.perf_counter()
        pending = None
        try:
            if self.desync_check and self._check is not None:
                if async_op and not self._gloo_data():  # [Note: overlapped check]
                    pending = self._check.start(rec, check_src)
                elif self.alarm is not None:  # the exchange, watched too
                    check = self._check.start(rec, check_src)
                    self._wait_watched(check.work)
                    self._check.finish(check)
                else:
                    self._check.exchange(rec, check_src)
            t1 = time.perf_counter()
            watched = self.alarm is not None and not async_op  # issued async, waited watched
            work = fn(*args, group=self._live(), async_op=async_op or watched, **kwargs)
            if watched:
                self._wait_watched(work)
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
                    return Timed(self, work, rec, (log, nbytes, t1), pending)
                fut.add_done_callback(lambda _f: log.add(rec, nbytes, time.perf_counter() - t1))
            return Timed(self, work, rec, check=pending)
        t2 = time.perf_counter()
        self.blocked_seconds += t2 - t0
        if log is not None:
            log.add(rec, nbytes, t2 - t1)
        return Done()

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, tag: str = ""
    ) -> Handle:
        """Reduce ``tensor`` in place across ranks (``op``: sum, avg, max or min; avg of a
        floating tensor only). ``tag`` says what the tensor is, for the desync check and
        reports."""
        if not self.active:
            return Done()
        if self.rules is not None:
            self.rules.check("all_reduce", (tensor,), self._group_name)
        if op == "avg":
            # gloo has no AVG: divide first, then sum (exact for the power-of-two sizes, and
            # it keeps magnitudes small).
            if not tensor.is_floating_point():
                raise TypeError(f"all_reduce(op='avg') needs a floating tensor, got {tensor.dtype}")
            tensor.div_(self.world_size)
            op = "sum"
        self.seq += 1
        if self.observing:
            return self._observed(
                "all_reduce",
                dist.all_reduce,
                tensor,
                op=_OPS[op],
                tensor=tensor,
                reduce_op=op,
                async_op=async_op,
                tag=tag,
                nbytes=tensor.numel() * tensor.element_size(),
            )
        return self._issue(dist.all_reduce, tensor, op=_OPS[op], async_op=async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        tag: str = "",
        scratch: bool = False,
    ) -> Handle:
        """Sum ``input`` across ranks; rank r keeps chunk r of the result in ``output``.
        ``tag`` says what the tensor is, for the desync check and reports. ``scratch``: the
        caller has no further use for ``input``, which may then be overwritten (on gloo it
        saves a copy of it: [Note: gloo reduce-scatter])."""
        in_place = scratch and self.active and self._gloo_cpu(input)
        fn = reduce_scatter_in_place if in_place else _reduce_scatter
        distinct = output.untyped_storage().data_ptr() != input.untyped_storage().data_ptr()
        if distinct and self._gloo_pair(output, input):
            fn = reduce_scatter_of_two  # [Note: gloo reduce-scatter of two]
        nbytes = input.numel() * input.element_size()
        return self._into(
            "reduce_scatter", fn, output, input, nbytes, async_op, tag, "sum", op=dist.ReduceOp.SUM
        )

    def _gloo_device(self, tensor: torch.Tensor) -> bool:
        """Whether this doorway's group is gloo's and ``tensor`` on an accelerator."""
        return self._gloo_data() and tensor.device.type != "cpu"

    def _gloo_pair(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """Whether this doorway is two gloo ranks and both tensors contiguous on the CPU, where
        the all-to-all forms of [Note: gloo all-gather of two] apply."""
        return (
            self.world_size == 2
            and self.active
            and self._gloo_cpu(input)
            and input.is_contiguous()
            and output.is_contiguous()
        )

    def _gloo_data(self) -> bool:
        """Whether this doorway's group is gloo's (asked once): its collectives are then
        checked before they are issued, asynchronous ones too ([Note: overlapped check])."""
        if self._gloo is None:
            self._gloo = dist.get_backend(self.group) == "gloo"
        return self._gloo

    def _gloo_cpu(self, tensor: torch.Tensor) -> bool:
        """Whether this doorway's group is gloo's and ``tensor`` on the CPU (asked once)."""
        return self._gloo_data() and tensor.device.type == "cpu"

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Handle:
        """Concatenate every rank's ``input`` (equal sizes, in rank order) into ``output``.
        ``tag`` says what the tensor is, for the desync check and reports."""
        nbytes = output.numel() * output.element_size()
        fn = _all_gather
        if self._gloo_pair(output, input):
            fn = all_gather_of_two  # [Note: gloo all-gather of two]
        return self._into("all_gather", fn, output, input, nbytes, async_op, tag)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Handle:
        """Chunk j of ``input`` goes to rank j; ``output`` holds every rank's chunk for this
        rank, in rank order (equal splits). ``tag`` says what the tensor is."""
        nbytes = input.numel() * input.element_size()
        fn = dist.all_to_all_single
        return self._into("all_to_all", fn, output, input, nbytes, async_op, tag)

    def _into(
        self,
        name: str,
        fn: Any,
        output: torch.Tensor,
        input: torch.Tensor,
        nbytes: int,
        async_op: bool,
        tag: str,
        reduce_op: str = "",
        **kwargs: Any,
    ) -> Handle:
        """What every collective from ``input`` into ``output`` does around ``fn``: in a group
        of one, ``output`` is ``input``; else the rules' check, the count, and the call,
        observed (desync check, record, comm log of ``nbytes``) or not."""
        if not self.active:
            output.copy_(input)
            return Done()
        if self.rules is not None:
            self.rules.check(name, (output, input), self._group_name)
        self.seq += 1
        if self.observing:
            return self._observed(
                name,
                fn,
                output,
                input,
                tensor=input,
                out=output,
                reduce_op=reduce_op,
                async_op=async_op,
                tag=tag,
                nbytes=nbytes,
                **kwargs,
            )
        return self._issue(fn, output, input, async_op=async_op, **kwargs)

    def count_replaced(self, op: str, nbytes: int) -> None:
        """The comm log's "would have sent" count ([Note: bytes saved] in ``commlog.py``)."""
        if self.commlog is not None and self.active:
            self.commlog.replace(op, nbytes)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with group rank ``src``'s copy."""
        if not self.active:
            return
        if self.rules is not None:
            self.rules.check("broadcast", (tensor,), self._group_name)
        self.seq += 1
        root = self.global_rank(src)  # torch names the root by its global rank
        if self.observing:
            self._observed(
                "broadcast",
                dist.broadcast,
                tensor,
                src=root,
                tensor=tensor,
                check_src=src,
                async_op=False,
                nbytes=tensor.numel() * tensor.element_size(),
            )
        else:
            self._issue(dist.broadcast, tensor, src=root, async_op=False)

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        if not self.active:
            return
        self.seq += 1
        if self.observing:
            self._observed("barrier", dist.barrier, tensor=None, async_op=False)
        else:
            self._issue(dist.barrier, async_op=False)
