"""``longboat run``: start N worker processes on this node over ``torch.distributed.elastic``.

The launcher is torch elastic's own agent (``LaunchConfig`` + ``elastic_launch``) running
``python -u script.py ...`` per worker, so a script written for torchrun runs unchanged: it sees
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. What longboat adds around it:

* a free port on 127.0.0.1 when none is given, and a store that listens only there;
* ``[rankN]: `` in front of every worker output line;
* one clear line naming the rank that failed first and how, and its status as our exit code;
* no process left behind, including ones a failed worker had started;
* usage errors that name the flag, the value and the fix (exit code 2).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from longboat import roles
from longboat.launch import tail
from longboat.launch.failures import WorkerExit, summarize
from longboat.launch.hangs import merge, read_reports, report_dir, wake_stopped_workers
from longboat.launch.output import report, worker_console
from longboat.launch.reaper import OrphanReaper
from longboat.launch.survivors import Survivors
from longboat.network import bind_listener, master_route_interface

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

# Same run id on every node: the static rendezvous prefixes its keys with it, so nodes with
# different ids would never meet. One job owns its store, so a constant is safe.
# torchrun's defaults: a fresh id per single-node run (its --standalone), "none" across nodes
# unless --rdzv-id gives one (every node must name the same, it prefixes the rendezvous store),
# and the role "default". Workers read them as TORCHELASTIC_RUN_ID and ROLE_NAME.
MULTINODE_RUN_ID = "none"
ROLE = "default"


def run_id(opts: RunOptions) -> str:
    """The job's TORCHELASTIC_RUN_ID: the given --rdzv-id, else torchrun's default."""
    if opts.rdzv_id:
        return opts.rdzv_id
    return uuid.uuid4().hex if opts.nnodes == 1 else MULTINODE_RUN_ID


# Put in every worker's environment (and so inherited by what it starts), naming this launch.
_MARKER_VAR = "LONGBOAT_LAUNCH_ID"
# How much of a failed rank's stderr is read to tell "crashed" from "lost a peer".
_STDERR_TAIL_BYTES = 4096


class _NewerLaunchFields(TypedDict, total=False):
    """``LaunchConfig`` fields that older torch versions lack."""

    shutdown_timeout: int  # torch >= 2.8


class LaunchUsageError(ValueError):
    """A bad flag value; the message names the flag, the value and the fix."""


@dataclass(frozen=True)
class RunOptions:
    """Everything ``longboat run`` needs to start this node's share of a job."""

    script: Path
    script_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    # -n MIN:MAX: the fewest workers a restart may start ([Note: elastic node]); None: fixed
    min_nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)
    max_restarts: int = 0
    log_dir: Path | None = None  # None: a temporary directory, removed afterwards
    rdzv_timeout_s: int = 900
    rdzv_id: str | None = None  # torchrun's --rdzv-id; None: see run_id()
    # On SIGTERM/SIGINT the agent forwards the signal to the workers and kills them only after
    # this many seconds: time for a final checkpoint (see Engine.should_stop).
    grace_period_s: int = 30
    # torchrun's --local-ranks-filter: the local ranks whose output is shown (None: all)
    local_ranks_filter: frozenset[int] | None = None
    rank_prefix: bool = True  # "[rankN]: " before each worker output line
    # Started by the hostfile launcher: stop (as on SIGTERM) when stdin closes, which is how
    # that launcher stops every node when one fails, through ssh as well.
    stop_on_stdin_eof: bool = False


def validate(opts: RunOptions) -> None:
    """Raise :class:`LaunchUsageError` for the first bad option, before anything starts."""
    if not opts.script.is_file():
        what = "is a directory" if opts.script.is_dir() else "does not exist"
        raise LaunchUsageError(
            f"script {str(opts.script)!r} {what}: give the path of a Python file, "
            f"e.g. `longboat run -n 2 train.py`"
        )
    if opts.nproc_per_node < 1:
        raise LaunchUsageError(
            f"-n/--nproc-per-node {opts.nproc_per_node} is invalid: a node needs at least one "
            "worker process; use -n 1 or more"
        )
    least = opts.min_nproc_per_node
    if least is not None and not 1 <= least <= opts.nproc_per_node:
        raise LaunchUsageError(
            f"-n {least}:{opts.nproc_per_node} is invalid: write MIN:MAX with 1 <= MIN <= MAX"
        )
    if least is not None and least < opts.nproc_per_node and opts.max_restarts < 1:
        raise LaunchUsageError(
            f"-n {least}:{opts.nproc_per_node} restarts with fewer workers after a failure, "
            "and --max-restarts is 0: give --max-restarts 1 or more (how many failures the job "
            f"survives), or a fixed -n {opts.nproc_per_node}"
        )
    if opts.nnodes < 1:
        raise LaunchUsageError(
            f"--nnodes {opts.nnodes} is invalid: a job has at least one node; use --nnodes 1 "
            "or more"
        )
    if not 0 <= opts.node_rank < opts.nnodes:
        raise LaunchUsageError(
            f"--node-rank {opts.node_rank} is out of range for --nnodes {opts.nnodes}: node "
            f"ranks go from 0 to {opts.nnodes - 1}; give each node a different one"
        )
    if opts.master_port is not None and not 1 <= opts.master_port <= 65535:
        raise LaunchUsageError(
            f"--master-port {opts.master_port} is not a TCP port: use 1-65535, or leave it out "
            "on a single node to pick a free port"
        )
    if opts.master_port is None and opts.nnodes > 1:
        raise LaunchUsageError(
            f"--master-port is required with --nnodes {opts.nnodes}: every node must name the "
            "same port on node 0, e.g. --master-port 29500"
        )
    if not opts.master_addr.strip():
        raise LaunchUsageError(
            "--master-addr is empty: give the address of node 0, e.g. --master-addr 10.0.0.1"
        )
    if opts.max_restarts < 0:
        raise LaunchUsageError(
            f"--max-restarts {opts.max_restarts} is invalid: use 0 (no restart) or more"
        )
    if opts.grace_period_s < 0:
        raise LaunchUsageError(
            f"--grace-period {opts.grace_period_s} is invalid: give seconds, 0 or more"
        )
    if opts.rdzv_timeout_s < 1:
        raise LaunchUsageError(
            f"--rdzv-timeout {opts.rdzv_timeout_s} is invalid: give seconds, at least 1"
        )


def _bind_store_socket(opts: RunOptions) -> tuple[int, int | None]:
    """Return (port, listening fd): node 0 binds the rendezvous socket now; others only dial."""
    if opts.node_rank != 0:
        if opts.master_port is None:  # validate() requires it for nnodes > 1
            raise LaunchUsageError("--master-port is required on nodes other than node 0")
        return opts.master_port, None
    try:
        sock = bind_listener(opts.master_addr, opts.master_port or 0)
    except OSError as e:
        reason = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            raise LaunchUsageError(
                f"--master-port {opts.master_port} is already in use on {opts.master_addr}: "
                "pick another port, or leave --master-port out on a single node to get a free one"
            ) from e
        raise LaunchUsageError(
            f"--master-addr {opts.master_addr} cannot be listened on here ({reason}): node 0 "
            "hosts the rendezvous, so give an address of this machine (127.0.0.1 on one machine)"
        ) from e
    port = sock.getsockname()[1]
    # The rendezvous store takes the fd over and serves on it for the life of the process.
    return port, sock.detach()


@contextlib.contextmanager
def _agent_environment(opts: RunOptions, marker: str, roles_dir: Path) -> Iterator[None]:
    """Set, for the duration of the launch, the variables the agent passes on to workers."""
    wanted = {
        _MARKER_VAR: marker,
        roles.ENV: str(roles_dir),
        # Lives as long as this launch, across its restarts: where hvd.elastic commits go.
        "LONGBOAT_STATE_DIR": str(roles_dir.parent / "state"),
        # With torch's c10d rendezvous the workers reuse the rendezvous store and, after a
        # restart, dial the previous attempt's ports ("Connection refused", pytorch#135712,
        # measured in RELIABILITY.md). Our rendezvous already gives each attempt a fresh store;
        # this keeps torch's own code paths on the safe side as well.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    # As torchrun: N processes each spawning one OpenMP thread per core overload the machine.
    if "OMP_NUM_THREADS" not in os.environ and opts.nproc_per_node > 1:
        wanted["OMP_NUM_THREADS"] = "1"
    # On one node too: left alone, gloo listens on whatever the hostname resolves to (an
    # address of the LAN on many machines) for as long as the job lives; the master's route
    # keeps a loopback job on loopback ([Note: listeners] in longboat/network.py).
    chosen, why = master_route_interface(opts.master_addr, os.environ)
    wanted.update(chosen)
    if chosen and opts.nnodes > 1:
        report(f"longboat: node {opts.node_rank}: gloo and NCCL use {why}")
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _restored_signal_handlers() -> Iterator[None]:
    """torch elastic installs handlers for these and never removes them; put ours back."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {sig: signal.getsignal(sig) for name in names if (sig := getattr(signal, name, None))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _stderr_tail(log_dir: Path, local_rank: int) -> str:
    """The end of a worker's stderr from the last attempt in ``log_dir`` ('' when absent)."""
    # torch elastic's layout: <log_dir>/<run_id>_<random>/attempt_<k>/<local_rank>/stderr.log
    files = sorted(
        log_dir.glob(f"*_*/attempt_*/{local_rank}/stderr.log"),
        key=lambda p: (p.stat().st_mtime, p.parent.parent.name),
    )
    if not files:
        return ""
    with open(files[-1], "rb") as f:
        f.seek(max(0, files[-1].stat().st_size - _STDERR_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _stop_when_stdin_closes() -> None:
    """Send ourselves SIGTERM once stdin reaches its end (see ``RunOptions.stop_on_stdin_eof``)."""

    def watch() -> None:
        # os.read on the descriptor, not sys.stdin: a daemon thread blocked in a buffered
        # read holds its lock, and interpreter shutdown then aborts trying to take it.
        try:
            while os.read(0, 4096):
                pass
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="longboat-stdin-eof", daemon=True).start()


def launch(opts: RunOptions) -> int:
    """Run this node's workers to the end; return the exit status the launcher should exit with.

    0 on success; for a failure, the failed rank's exit code, or 128 + signal number when a
    signal killed it (as a shell reports it). Raises :class:`LaunchUsageError` for bad options.
    """
    validate(opts)
    # Imported here so usage errors do not pay for importing torch.
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    from longboat.launch import rendezvous

    port, listen_fd = _bind_store_socket(opts)
    rendezvous.register_backend()
    marker = uuid.uuid4().hex
    reaper = OrphanReaper(f"{_MARKER_VAR}={marker}")

    with contextlib.ExitStack() as stack:
        if opts.log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="longboat-")))
        else:
            log_dir = opts.log_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        roles_dir = log_dir / "roles"  # [Note: rank roles] in longboat/roles.py
        roles_dir.mkdir(exist_ok=True)
        survivors = Survivors(roles_dir, report, opts.max_restarts)
        # Entered after the log directory, so leftovers are ended before it is removed.
        stack.enter_context(_agent_environment(opts, marker, roles_dir))
        stack.enter_context(_restored_signal_handlers())
        reports = stack.enter_context(report_dir(log_dir))
        stack.enter_context(wake_stopped_workers())
        stack.enter_context(reaper)
        stack.enter_context(
            worker_console(
                opts.node_rank,
                opts.nproc_per_node,
                opts.max_restarts,
                opts.rank_prefix,
                survivors.last_words.first_failure,
            )
        )
        stack.enter_context(survivors.watching())
        if opts.stop_on_stdin_eof:
            _stop_when_stdin_closes()

        # torch < 2.8 has no shutdown_timeout field; its agent then always waits 30 s.
        newer: _NewerLaunchFields = (
            {"shutdown_timeout": opts.grace_period_s}
            if "shutdown_timeout" in LaunchConfig.__dataclass_fields__
            else {}
        )
        rdzv_configs: dict[str, object] = {"rank": opts.node_rank, "timeout": opts.rdzv_timeout_s}
        if listen_fd is not None:
            rdzv_configs[rendezvous.LISTEN_FD_KEY] = listen_fd
        if opts.master_port is not None:
            rdzv_configs[rendezvous.WORKER_PORT_BASE_KEY] = opts.master_port + 1
        config = LaunchConfig(
            min_nodes=opts.nnodes,
            max_nodes=opts.nnodes,
            nproc_per_node=opts.nproc_per_node,
            run_id=run_id(opts),
            role=ROLE,
            # Static rendezvous (torchrun --node-rank semantics) rather than c10d: node ranks
            # are the user's, one code path serves one node and many, and node 0 stays the host.
            # Ours adds a fresh worker store per attempt, which makes restarts reliable (see
            # rendezvous.py). Not elastic: no node joins mid-job; longboat does not need that.
            rdzv_backend=rendezvous.BACKEND,
            rdzv_endpoint=f"{opts.master_addr}:{port}",
            rdzv_configs=rdzv_configs,
            max_restarts=opts.max_restarts,
            monitor_interval=0.1,
            start_method="spawn",
            # Prefixes are only applied to tee'd output: the agent redirects each stream to a
            # file under log_dir and tails it onto ours, adding the prefix to every line.
            log_line_prefix_template="[rank${rank}]: ",
            logs_specs=DefaultLogsSpecs(
                log_dir=str(log_dir),
                tee=Std.ALL,
                local_ranks_filter=(
                    set(opts.local_ranks_filter) if opts.local_ranks_filter is not None else None
                ),
            ),
            **newer,
        )
        code = _run_agent(config, opts, log_dir, port, roles_dir)
        if code:
            for line in merge(read_reports(reports)):
                report(line)
        elif survivors.dropped:
            # One node holds every rank: if every droppable one died, no worker is left.
            # (Across nodes each launcher sees only its own; the servers' watch covers that.)
            failed = survivors.all_failed() if opts.nnodes == 1 else None
            if failed is not None:
                report(
                    f"longboat: every rank the job could go on without failed ({failed}); "
                    "none finished its training, so the job failed"
                )
                code = 1
            else:
                ranks = ", ".join(map(str, sorted(survivors.dropped)))
                report(
                    f"longboat: the job finished without rank(s) {ranks}, dropped when they died"
                )

    if reaper.ended:
        pids = ", ".join(map(str, sorted(reaper.ended)))
        report(f"longboat: ended {len(reaper.ended)} process(es) the workers left behind: {pids}")
    return code


def _run_agent(
    config: LaunchConfig, opts: RunOptions, log_dir: Path, port: int, roles_dir: Path
) -> int:
    """Run torch elastic's agent with ``config``; turn its outcome into reports and a status."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from longboat.launch.rendezvous import RendezvousFailed

    # The workers' last lines reach our output even when they end as the agent looks
    # ([Note: tail race] in tail.py).
    tail.install()
    least = opts.min_nproc_per_node
    try:
        with contextlib.ExitStack() as stack:
            if least is not None and least < opts.nproc_per_node:
                from longboat.launch.elastic import elastic_node

                stack.enter_context(elastic_node(least, report))
            elastic_launch(config, sys.executable)("-u", str(opts.script), *opts.script_args)
    except ChildFailedError as e:
        summary = summarize(
            WorkerExit(
                rank=rank,
                pid=f.pid,
                exitcode=f.exitcode,
                timestamp=f.timestamp,
                stderr_tail=_stderr_tail(log_dir, f.local_rank),
            )
            for rank, f in e.failures.items()
        )
        for line in summary.lines:
            report(line)
        role = roles.read(roles_dir).get(summary.root.rank)
        if role is not None:
            report(f"longboat: rank {summary.root.rank} was {role.what}")
        if opts.max_restarts:
            report(f"longboat: giving up after {opts.max_restarts + 1} attempts")
        if opts.log_dir is not None:
            report(f"longboat: per-rank logs are in {log_dir}")
        return summary.exit_code
    except SignalException as e:
        # The agent already sent the same signal to the workers and waited for them to stop.
        report(
            f"longboat: stopped by {signal.Signals(e.sigval).name}; workers were stopped "
            f"(after at most --grace-period {opts.grace_period_s} s to finish)"
        )
        return 128 + int(e.sigval)
    except RendezvousFailed as e:
        report(f"longboat: {e}")
        report(
            f"longboat: start every node with the same --nnodes {opts.nnodes}, --master-addr "
            "and --master-port, node 0 among them; --rdzv-timeout sets how long to wait"
        )
        return 1
    except DistError as e:
        # Raised while the nodes meet: node 0 not up, a node missing, or a port unreachable.
        report(
            f"longboat: rendezvous at {opts.master_addr}:{port} failed ({type(e).__name__}: {e})"
        )
        report(
            f"longboat: start every node with the same --nnodes {opts.nnodes}, --master-addr "
            "and --master-port, node 0 among them; --rdzv-timeout sets how long to wait"
        )
        return 1
    return 0
