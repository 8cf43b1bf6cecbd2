"""``longboat run --hostfile`` / ``-H``: start one node agent per host through a remote shell.

What DeepSpeed's runner and ``horovodrun`` do, on longboat's node agent (``longboat run
--nnodes N --node-rank i`` on each host, see :mod:`longboat.launch.run`):

1. every host is checked first (``ssh host true``), and each one that cannot run commands is
   named with the shell's own words;
2. interface discovery (:mod:`longboat.launch.discovery`) picks each host's interface; node 0's
   address on it becomes the master address, and each host's workers get it as
   ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` unless the user set those (then they are
   checked against what discovery found, and kept);
3. the agents start with the forwarded environment (:mod:`longboat.launch.forward_env`) in the
   same working directory and Python; their output comes back line by line as ``host: line``;
4. when one host's agent fails, every other is stopped: its stdin is closed, which its agent
   (started with ``--stop-on-eof``) takes as SIGTERM, giving the workers ``--grace-period``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from longboat.launch.discovery import Discovery, DiscoveryError, discover
from longboat.launch.forward_env import forwarded
from longboat.launch.hosts import Host
from longboat.launch.output import report
from longboat.launch.run import RunOptions
from longboat.launch.shells import RemoteShell, command_line
from longboat.network import HOSTS_VAR

DEFAULT_PORT = 29500
CHECK_TIMEOUT_S = 10
_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class HostsRun:
    """A job over several hosts: the hosts, how to reach them, and each node's options."""

    hosts: tuple[Host, ...]
    shell: RemoteShell
    node: RunOptions  # script, arguments, restarts, timeouts, output options
    master_port: int = DEFAULT_PORT
    master_addr: str | None = None  # None: node 0's address on its discovered interface


def check_hosts(shell: RemoteShell, hosts: Sequence[str]) -> dict[str, str]:
    """Host -> why it cannot run commands (empty when all can), all checked at once."""

    def one(host: str) -> str | None:
        argv = shell.check_argv(host, CHECK_TIMEOUT_S)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(argv)}` did not answer in {CHECK_TIMEOUT_S + 5} s"
        except OSError as e:
            return f"`{argv[0]}` cannot be run here ({e.strerror or e})"
        if done.returncode == 0:
            return None
        said = " | ".join(done.stderr.strip().splitlines()[-2:]) or "no message"
        return f"`{' '.join(argv)}` exited with status {done.returncode}: {said}"

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        outcomes = dict(zip(hosts, pool.map(one, hosts), strict=True))
    return {h: why for h, why in outcomes.items() if why is not None}


def _node_argv(run: HostsRun, rank: int, host: Host, master_addr: str) -> list[str]:
    o = run.node
    argv = [
        sys.executable,
        "-u",
        "-m",
        "longboat.cli",
        "run",
        "--nnodes",
        str(len(run.hosts)),
        "--node-rank",
        str(rank),
        "--master-addr",
        master_addr,
        "--master-port",
        str(run.master_port),
        "-n",
        str(host.nproc),
        "--max-restarts",
        str(o.max_restarts),
        "--rdzv-timeout",
        str(o.rdzv_timeout_s),
        "--grace-period",
        str(o.grace_period_s),
        "--stop-on-eof",
    ]
    if o.rdzv_id:
        argv += ["--rdzv-id", o.rdzv_id]
    if o.log_dir is not None:
        argv += ["--log-dir", str(o.log_dir.absolute() / host.name)]
    if o.local_ranks_filter is not None:
        argv += ["--local-ranks-filter", ",".join(map(str, sorted(o.local_ranks_filter)))]
    if not o.rank_prefix:
        argv.append("--no-rank-prefix")
    return [*argv, str(o.script), *o.script_args]


def _describe(found: Discovery) -> str:
    parts = []
    for name, net in found.hosts.items():
        skipped = [n for n in net.interfaces if n not in net.reachable]
        parts.append(
            f"{name} {net.chosen} ({net.address})"
            + (f", skipped {', '.join(skipped)}" if skipped else "")
        )
    return f"longboat: interfaces ({found.seconds:.1f} s): " + "; ".join(parts)


def _check_user_interface(found: Discovery, env: dict[str, str]) -> None:
    """A user's interface variable is kept; say where it names an interface peers cannot reach."""
    for var in _IFNAME_VARS:
        value = env.get(var)
        if not value or value.startswith("^"):
            continue
        names = [n.strip().lstrip("=") for n in value.split(",") if n.strip()]
        for host, net in found.hosts.items():
            if not any(n in net.reachable for n in names):
                report(
                    f"longboat: warning: {var}={value} on host {host}, but the interfaces every "
                    f"other host reaches there are: {', '.join(net.reachable) or 'none'}; "
                    f"kept as set (unset {var} to use {net.chosen})"
                )


class _Node:
    """One host's agent: its local shell process and the threads copying its output."""

    def __init__(self, host: str, argv: list[str]) -> None:
        self.host = host
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self.threads = [
            threading.Thread(target=self._copy, args=(self.proc.stdout, sys.stdout), daemon=True),
            threading.Thread(target=self._copy, args=(self.proc.stderr, sys.stderr), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _copy(self, src: object, dst: TextIO) -> None:
        prefix = f"{self.host}: "
        for raw in iter(src.readline, b""):  # type: ignore[attr-defined]
            dst.write(prefix + raw.decode(errors="replace"))
            dst.flush()

    def stop(self) -> None:
        """Close the agent's stdin: it stops its workers as on SIGTERM."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def launch_hosts(run: HostsRun) -> int:
    """Run the job on every host; return the first failed node's status (0 when all succeed)."""
    names = [h.name for h in run.hosts]
    unreachable = check_hosts(run.shell, names)
    if unreachable:
        for name, why in unreachable.items():
            report(f"longboat: host {name} cannot run commands through {run.shell.name}: {why}")
        report(
            f"longboat: not starting: {len(unreachable)} of {len(names)} host(s) unreachable; "
            "fix them or leave them out with --exclude"
        )
        return 1
    cwd = Path.cwd()
    env = forwarded(os.environ, cwd)
    found: Discovery | None = None
    if len(names) > 1:
        try:
            found = discover(run.shell, names, run.master_port, sys.executable, cwd, env)
        except DiscoveryError as e:
            report(f"longboat: interface discovery failed: {e}")
            return 1
        report(_describe(found))
        _check_user_interface(found, env)
    master_addr = run.master_addr or (found.hosts[names[0]].address if found else "127.0.0.1")
    assert master_addr is not None

    nodes = []
    for rank, host in enumerate(run.hosts):
        node_env = dict(env)
        node_env[HOSTS_VAR] = ",".join(names)
        if found is not None:
            iface = found.interface_of(host.name)
            node_env.setdefault("GLOO_SOCKET_IFNAME", iface)
            node_env.setdefault("NCCL_SOCKET_IFNAME", "=" + iface)  # exact name, not a prefix
        if not host.all_slots:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, host.slots))
        argv = run.shell.argv(
            host.name, command_line(cwd, node_env, _node_argv(run, rank, host, master_addr))
        )
        nodes.append(_Node(host.name, argv))
    return _supervise(nodes, run.node.grace_period_s)


def _supervise(nodes: list[_Node], grace_period_s: int) -> int:
    """Wait for every node; when one fails (or we are signalled), stop the others."""
    stop = threading.Event()
    signalled: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        signalled.append(signum)
        stop.set()

    saved = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    deadline: float | None = None
    try:
        while True:
            running = [n for n in nodes if n.proc.poll() is None]
            failed = [n for n in nodes if n.proc.returncode not in (None, 0)]
            if failed and not code:
                first = failed[0]
                code = _status(first.proc.returncode)
                if running:
                    report(
                        f"longboat: host {first.host} failed (status {code}); stopping "
                        f"{', '.join(n.host for n in running)}"
                    )
                stop.set()
            if stop.is_set() and deadline is None:
                for n in running:
                    n.stop()
                deadline = time.monotonic() + grace_period_s + 15
            if not running:
                break
            if deadline is not None and time.monotonic() > deadline:
                for n in running:
                    report(f"longboat: host {n.host} did not stop in time; killing its shell")
                    n.proc.kill()
            time.sleep(0.1)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    for n in nodes:
        for t in n.threads:
            t.join(timeout=5)
    if signalled:  # the nodes ended because we were stopped: say so, as a shell would
        code = 128 + signalled[0]
    return code


def _status(returncode: int) -> int:
    """A local process's return code as a shell reports it (128 + N for signal N)."""
    return 128 - returncode if returncode < 0 else returncode
