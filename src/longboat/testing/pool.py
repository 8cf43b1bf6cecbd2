"""The parent side of the rank pool: :class:`RankPool` (one world size) and :class:`RankPools`
(one pool per world size, started on first use)."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from longboat.testing.common import HOST, LEFT_THREADS, RankFailure
from longboat.testing.worker import probe_group, stacks_file, worker_main

# Seconds an intact group takes to answer the probe after a failed call: milliseconds, but the
# workers may share the cores with other jobs.
PROBE_TIMEOUT_S = 20.0
# Seconds a worker that did not answer is given to write where its threads are.
STACKS_WAIT_S = 1.0


def _free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1 (rank 0 binds it for the TCPStore)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _kill_workers(
    processes: list[multiprocessing.process.BaseProcess],
    conns: list[Connection],
    owner_pid: int,
    stacks_dir: str,
) -> None:
    """SIGKILL and reap workers; SIGTERM is not enough for one blocked in a collective."""
    if os.getpid() != owner_pid:
        return  # a forked copy of the parent exiting: the workers are not its to kill
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=10)
    for conn in conns:
        conn.close()
    shutil.rmtree(stacks_dir, ignore_errors=True)


def _stacks(processes: list[multiprocessing.process.BaseProcess], paths: list[str]) -> list[str]:
    """Where the threads of workers that did not answer are: each is asked (SIGUSR1, which
    its faulthandler answers in its path) and all are given :data:`STACKS_WAIT_S` to write."""
    asked = []
    for process in processes:
        if process.pid is not None and process.is_alive():
            with contextlib.suppress(OSError):
                os.kill(process.pid, signal.SIGUSR1)
                asked.append(process)
    if asked:
        time.sleep(STACKS_WAIT_S)
    out = []
    for process, path in zip(processes, paths, strict=True):
        text = ""
        if process in asked:
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                text = f.read()[-8000:]
        out.append(text)
    return out


@dataclass
class _Generation:
    """One set of live workers and the port their process group uses."""

    port: int
    processes: list[multiprocessing.process.BaseProcess]
    conns: list[Connection]
    finalizer: weakref.finalize[
        [list[multiprocessing.process.BaseProcess], list[Connection], int, str], RankPool
    ]
    stacks_dir: str  # where each worker writes its threads' stacks when asked
    ready: bool = False


def _callable_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


class RankPool:
    """``world_size`` spawned worker processes sharing one gloo process group.

    Workers are spawned by the constructor and joined lazily: the first :meth:`run` waits
    for them, so starting several pools, or restarting one after a failure, overlaps with
    whatever the caller does meanwhile.

    Args:
        world_size: number of ranks (1 gives a real process group of size 1).
        timeout: default seconds a :meth:`run` waits for all ranks to answer. Also the
            gloo collective timeout, so a collective never gives up before the parent does.
        start_timeout: seconds to wait for the workers to import torch and join the group.
        error_grace: once one rank has failed, seconds to wait for the others before
            declaring them stuck. Short, because the usual reason they have not answered
            is that they wait in a collective the failed rank will never join.
    """

    def __init__(
        self,
        world_size: int,
        timeout: float = 120.0,
        *,
        start_timeout: float = 120.0,
        error_grace: float = 3.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.error_grace = error_grace
        self._ctx = multiprocessing.get_context("spawn")
        self._generation: _Generation | None = None
        self._closed = False
        self._spawn()

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """MASTER_PORT of the current workers, or None when closed."""
        return None if self._generation is None else self._generation.port

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers, in rank order (empty when closed)."""
        if self._generation is None:
            return []
        return [p.pid for p in self._generation.processes if p.pid is not None]

    def _spawn(self) -> None:
        """Start a fresh set of workers on a fresh port, without waiting for them."""
        port = _free_port()
        stacks_dir = tempfile.mkdtemp(prefix="longboat-pool-")
        processes: list[multiprocessing.process.BaseProcess] = []
        conns: list[Connection] = []
        for rank in range(self.world_size):
            parent_end, child_end = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    self.world_size,
                    port,
                    list(sys.path),
                    child_end,
                    os.getpid(),
                    float(self.timeout),
                    stacks_file(stacks_dir, rank),
                ),
                name=f"RankPool-{self.world_size}-rank{rank}",
                # Not daemonic, so calls may start processes (DataLoader workers);
                # cleanup at exit is done by the finalizer registered below instead.
                daemon=False,
            )
            process.start()
            # Drop our copy of the child's end so a dead worker reads as EOF here.
            child_end.close()
            processes.append(process)
            conns.append(parent_end)
        finalizer = weakref.finalize(self, _kill_workers, processes, conns, os.getpid(), stacks_dir)
        # Registered with atexit ourselves (not via finalize's own hook) so that it runs
        # before multiprocessing's exit handler, which would join the workers forever.
        finalizer.atexit = False
        atexit.register(finalizer)
        self._generation = _Generation(port, processes, conns, finalizer, stacks_dir)

    def _kill(self) -> None:
        """Kill the current workers, if any."""
        generation, self._generation = self._generation, None
        if generation is not None:
            atexit.unregister(generation.finalizer)
            generation.finalizer()

    def restart(self) -> None:
        """Replace all workers with fresh ones on a new port."""
        self._check_open()
        self._kill()
        self._spawn()

    def close(self) -> None:
        """Stop the workers: politely first, then by SIGKILL. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        generation = self._generation
        if generation is not None and generation.ready:
            message = pickle.dumps(("close", [], b""))
            for conn in generation.conns:
                with contextlib.suppress(OSError):
                    conn.send_bytes(message)
            deadline = time.monotonic() + 5.0
            for process in generation.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RankPool is closed")

    def _ensure_ready(self) -> _Generation:
        """Wait until every worker has joined the process group; retry a failed start once.

        One retry covers the port picked by :func:`_free_port` being taken by someone else
        before rank 0 bound it.
        """
        self._check_open()
        failures: dict[int, str] = {}
        for _attempt in range(2):
            if self._generation is None:
                self._spawn()
            generation = self._generation
            assert generation is not None
            if generation.ready:
                return generation
            _, failures, _, _ = self._collect(generation, self.start_timeout, grace=1.0)
            if not failures:
                generation.ready = True
                return generation
            self._kill()
        self._spawn()  # leave a fresh attempt running for the next call
        raise RankFailure(
            self._report(f"starting a pool of {self.world_size}", failures, self.start_timeout),
            failures,
        )

    # ---- calls -----------------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``timeout`` (seconds, default: the pool's) is consumed here; use :meth:`call` to
        pass an argument named ``timeout`` through to ``fn``.

        Raises:
            RankFailure: a rank raised, died, or did not answer within ``timeout``. The pool
                can be used again: its workers were replaced, unless every rank raised and
                a probe found the group intact (:meth:`_group_survived`).
            pickle.PicklingError, AttributeError, TypeError: ``fn`` or the arguments cannot
                be pickled; nothing was sent and the pool is untouched.
        """
        __tracebackhide__ = True  # pytest: show the test's frame, not ours
        return self.call(fn, args, kwargs, timeout=timeout)

    def call(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> list[Any]:
        """Like :meth:`run`, with the arguments given as a tuple and a mapping."""
        __tracebackhide__ = True  # pytest: show the test's frame, not ours
        limit = self.timeout if timeout is None else timeout
        # Pickle before sending anything: a lambda or a local function fails here, in the
        # caller, instead of leaving some ranks running and others not.
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})), pickle.HIGHEST_PROTOCOL)
        message = pickle.dumps(("call", list(sys.path), payload), pickle.HIGHEST_PROTOCOL)
        try:
            generation = self._ensure_ready()
            results, failures, clean, raised = self._exchange(generation, message, limit)
        except RankFailure:
            raise  # the pool failed to start; a fresh start is already under way
        except BaseException:
            # Interrupted (Ctrl-C) mid-call or mid-start: replies still in flight would be
            # taken for the next call's, so drop these workers; the next call starts anew.
            self._kill()
            raise
        if failures:
            # Threads a call left running live on in its workers: only fresh ones are rid of them.
            leaked = any(LEFT_THREADS in text for text in failures.values())
            if leaked:
                clean = False
            elif not clean and len(raised) == self.world_size and self._group_survived(generation):
                clean = True
            if not clean:
                self.restart()
            raise RankFailure(
                self._report(_callable_name(fn), failures, limit, restarted=not clean),
                failures,
            )
        return [results[rank] for rank in range(self.world_size)]

    def _group_survived(self, generation: _Generation) -> bool:
        """Whether the process group still pairs every rank's collectives after a call in
        which every rank raised.

        Each worker answered, so none waits in a collective, and restarting them all costs
        seconds of torch imports per rank (refusal tests do this on purpose, hundreds of
        times in a suite). What an answer does not show is a collective one rank launched
        asynchronously before raising: it would pair with the next call's first collective.
        A probe with a fresh token finds that (a wrong sum, a size mismatch, or no answer
        within :data:`PROBE_TIMEOUT_S`), and only then are the workers replaced.
        """
        token = random.randrange(1, 1 << 20)
        payload = pickle.dumps((probe_group, (token,), {}), pickle.HIGHEST_PROTOCOL)
        message = pickle.dumps(("call", list(sys.path), payload), pickle.HIGHEST_PROTOCOL)
        results, failures, _, _ = self._exchange(generation, message, PROBE_TIMEOUT_S)
        return not failures and all(results.get(r) is True for r in range(self.world_size))

    def _exchange(
        self, generation: _Generation, message: bytes, limit: float
    ) -> tuple[dict[int, Any], dict[int, str], bool, set[int]]:
        """Send ``message`` to every rank and collect the replies, as :meth:`_collect`."""
        failures: dict[int, str] = {}
        for rank, conn in enumerate(generation.conns):
            try:
                conn.send_bytes(message)
            except OSError as exc:
                failures[rank] = f"could not be sent the call ({exc!r}); the worker is gone"
        if failures:
            return {}, failures, False, set()
        return self._collect(generation, limit, grace=self.error_grace)

    def _collect(
        self, generation: _Generation, limit: float, grace: float
    ) -> tuple[dict[int, Any], dict[int, str], bool, set[int]]:
        """Read one reply per rank; ranks silent at the deadline become failures.

        The deadline is ``limit`` after now, cut to ``grace`` after the first failure.
        Returns results and failures by rank, whether every failure left its worker idle
        and the process group intact (results that could not be pickled or unpickled), so
        that no restart is needed, and the ranks whose call raised.
        """
        start = time.monotonic()
        deadline = start + limit
        pending = {conn: rank for rank, conn in enumerate(generation.conns)}
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        raised: set[int] = set()
        clean = True
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                assert isinstance(conn, Connection)  # wait returns some of the ones it was given
                rank = pending.pop(conn)
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    clean = False
                    process = generation.processes[rank]
                    process.join(timeout=1.0)
                    failures[rank] = f"worker died (exit code {process.exitcode})"
                except Exception:
                    # The worker answered, so it is idle; only this reply is lost.
                    failures[rank] = "its reply could not be unpickled:\n" + (
                        traceback.format_exc()
                    )
                else:
                    if status in ("error", "unpicklable"):
                        failures[rank] = value
                        clean = clean and status == "unpicklable"
                        if status == "error":
                            raised.add(rank)
                    else:
                        results[rank] = value
                if rank in failures and not clean:
                    deadline = min(deadline, time.monotonic() + grace)
        waited = time.monotonic() - start
        silent = sorted(pending.values())
        wheres = _stacks(
            [generation.processes[r] for r in silent],
            [stacks_file(generation.stacks_dir, r) for r in silent],
        )
        for rank, where in zip(silent, wheres, strict=True):
            clean = False
            failures[rank] = (
                f"did not answer within {waited:.1f} s (likely waiting in a collective)"
            )
            if where:
                failures[rank] += "; where its threads were:\n" + where
        return results, failures, clean, raised

    def _report(
        self, what: str, failures: Mapping[int, str], limit: float, *, restarted: bool = True
    ) -> str:
        """Human-readable summary: one section per failed rank, in rank order."""
        ok = [rank for rank in range(self.world_size) if rank not in failures]
        aftermath = "the pool was restarted" if restarted else "the pool is still usable"
        lines = [
            f"{len(failures)} of {self.world_size} ranks failed in {what} "
            f"(timeout {limit:g} s); {aftermath}."
        ]
        if ok:
            lines.append(f"Ranks that answered normally: {', '.join(map(str, ok))}.")
        for rank in sorted(failures):
            lines.append(f"--- rank {rank} ---")
            lines.append(failures[rank].rstrip())
        return "\n".join(lines)


class RankPools:
    """Lazily created :class:`RankPool` objects, one per world size, closed together.

    Calling it runs a function: ``pools(2, fn, x, timeout=30)`` is
    ``RankPool(2).run(fn, x, timeout=30)`` with the pool kept for the next call.
    """

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self._pools: dict[int, RankPool] = {}

    def pool(self, world_size: int) -> RankPool:
        """The pool for ``world_size`` ranks, started on first use."""
        pool = self._pools.get(world_size)
        if pool is None:
            pool = self._pools[world_size] = RankPool(world_size, timeout=self.timeout)
        return pool

    def __call__(
        self,
        world_size: int,
        fn: Callable[..., Any],
        /,
        *args: Any,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; see :meth:`RankPool.run`."""
        __tracebackhide__ = True  # pytest: show the test's frame, not ours
        return self.pool(world_size).call(fn, args, kwargs, timeout=timeout)

    def close(self) -> None:
        """Close every pool started so far."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    def __enter__(self) -> RankPools:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
