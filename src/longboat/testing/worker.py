"""The worker side of the rank pool: each spawned process joins the gloo group once, then runs
the functions it is sent until its parent goes away. Everything here runs in the workers."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from longboat.testing.common import HOST, LEFT_THREADS, ORPHAN_POLL_S, POOL_ENV_VAR

#: Seconds a thread a call started is given to end after the call returned.
LEAK_GRACE_S = 2.0


def _exit_when_orphaned(parent_pid: int) -> None:
    """Kill this worker once its parent is gone.

    Runs in a daemon thread, so it also works while the main thread is blocked inside a
    gloo collective (those release the GIL). Without it a crashed test run would leave
    workers waiting forever.
    """
    while True:
        time.sleep(ORPHAN_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _exit_now() -> None:
    """Exit the worker without interpreter teardown.

    Unloading torch costs about a CPU-second per worker, which adds up on a small machine
    when a pool of four closes, and nothing in a worker needs finalising.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _format_call_error(exc: BaseException) -> str:
    """Format ``exc`` without the worker loop's own frame, which every traceback shares."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _loopback_interface() -> str | None:
    """Name of the loopback interface ('lo' on Linux, 'lo0' on macOS), if one is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None


def _extend_sys_path(paths: Iterable[str]) -> None:
    """Append entries of the parent's sys.path that this process lacks, keeping order."""
    for path in paths:
        if path not in sys.path:
            sys.path.append(path)


def _send(conn: Connection, status: str, value: Any) -> None:
    """Send ``(status, value)``.

    A value that cannot be pickled is reported with its own status, "unpicklable": the
    call itself completed, so unlike an error it gives no reason to restart the pool.
    """
    try:
        data = pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        data = pickle.dumps(
            (
                "unpicklable",
                "the result could not be pickled (return CPU tensors or plain Python "
                "values):\n" + traceback.format_exc(),
            )
        )
    conn.send_bytes(data)


def probe_group(token: int) -> bool:
    """All-reduce ``token`` and the rank, and agree whether every rank saw the exact sums: a
    collective left unpaired by an earlier call would pair with these and break them."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    seen = torch.tensor([float(token), float(dist.get_rank())], dtype=torch.float64)
    dist.all_reduce(seen)
    exact = seen.tolist() == [float(token * world), float(world * (world - 1) // 2)]
    agreed = torch.tensor([1.0 if exact else 0.0], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item() == 1.0)


def _longboat_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("longboat-")}


def _left_running(before: set[threading.Thread]) -> list[str]:
    """Names of longboat's threads a call started and left alive (each given until
    ``LEAK_GRACE_S`` after the call to end). One left behind lives on in this worker into later
    tests: it can hold the interpreter's locks when a DataLoader forks (a child deadlocked in
    ``os.fork`` so, a parameter server's heartbeat thread alive in its parent) or talk on a
    group another test uses."""
    left = _longboat_threads() - before
    deadline = time.monotonic() + LEAK_GRACE_S
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in left if t.is_alive())


def stacks_file(directory: str, rank: int) -> str:
    """Where worker ``rank`` writes its threads' stacks when asked."""
    return os.path.join(directory, f"rank{rank}.stacks")


def worker_main(
    rank: int,
    world_size: int,
    port: int,
    sys_path: list[str],
    conn: Connection,
    parent_pid: int,
    pg_timeout_s: float,
    stacks: str,
) -> None:
    """Entry point of one pool worker: join the process group, then serve calls. Asked by
    SIGUSR1 (the pool does when a call times out), it writes its threads' stacks to ``stacks``."""
    _extend_sys_path(sys_path)
    # Open for the process's life: faulthandler writes to its descriptor from a signal handler.
    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)  # noqa: SIM115
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    os.environ.update(
        {
            "MASTER_ADDR": HOST,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            POOL_ENV_VAR: "1",
        }
    )
    # Without this gloo picks the interface the hostname resolves to, which on some
    # machines is not reachable from itself; everything here is on 127.0.0.1 anyway.
    loopback = _loopback_interface()
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    try:
        import torch
        import torch.distributed as dist

        from longboat.world import bound_store

        # N workers share a few cores; intra-op threads per worker would only thrash.
        torch.set_num_threads(1)
        timeout = timedelta(seconds=pg_timeout_s)
        # Rank 0 serves the store on 127.0.0.1 only: env:// would listen on every interface.
        store = bound_store(HOST, port, rank, world_size, timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    except BaseException:
        _send(conn, "error", traceback.format_exc())
        return
    _send(conn, "ready", None)

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            _exit_now()  # the parent closed our pipe or died: nothing more will come
        # Outer layer holds only builtins, so it always unpickles; the call itself is
        # unpickled after sys.path is extended, because it may name a test module that
        # was imported (and put on the parent's sys.path) after this worker started.
        kind, sys_path, payload = pickle.loads(message)
        if kind == "close":
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            _exit_now()
        _extend_sys_path(sys_path)
        before = _longboat_threads()
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
        except BaseException as exc:
            error = _format_call_error(exc)
            if left := _left_running(before):
                error += f"\n({LEFT_THREADS}: {', '.join(left)})"
            _send(conn, "error", error)
            continue
        if left := _left_running(before):
            # An error, so that the pool starts fresh workers: the threads cannot be stopped.
            _send(conn, "error", f"{LEFT_THREADS}: {', '.join(left)}")
            continue
        if not dist.is_initialized():
            # Later calls rely on the shared group; fail loudly so the pool restarts.
            _send(conn, "error", "the call destroyed the default process group")
            continue
        _send(conn, "ok", result)
