"""Interface discovery: on each host, the network interface that every other host reaches.

Gloo and NCCL pick an interface per process (gloo: whatever the hostname resolves to; NCCL:
the first that is not loopback or ``docker*``). On a machine with a bridge, a VPN or a second
network, that choice can be an address the peers cannot reach, or one that exists on every host
(a docker bridge's ``172.17.0.1``) and so leads each peer back to itself: the job hangs or
fails in ``connectFullMesh``. So, as Horovod's launcher does, longboat asks the network instead
of guessing: a probe on every host (:mod:`longboat.launch.probe`) listens on each of its
addresses, every host dials every other host's addresses, and an interface counts for a host
only if *every* peer reached it and was answered by that host's token. Each host then gets the
first such interface (in the order the kernel lists them) as ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME``; names may differ between hosts (``eth0`` here, ``ens5`` there).
"""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from longboat.launch.shells import RemoteShell, command_line


class DiscoveryError(RuntimeError):
    """No usable interface on some host; the message names the host and what was tried."""


@dataclass(frozen=True)
class HostNetwork:
    """What discovery learned about one host."""

    interfaces: dict[str, list[str]]  # name -> IPv4 addresses (loopback left out)
    reachable: list[str]  # interfaces every peer reached, in the kernel's order
    chosen: str | None = None
    failed: dict[str, str] = field(default_factory=dict)  # "peer interface addr" -> why

    @property
    def address(self) -> str | None:
        """The chosen interface's first address: what peers dial for this host."""
        return self.interfaces[self.chosen][0] if self.chosen else None


@dataclass(frozen=True)
class Discovery:
    """Every host's network, in host order."""

    hosts: dict[str, HostNetwork]
    seconds: float

    def interface_of(self, host: str) -> str:
        chosen = self.hosts[host].chosen
        assert chosen is not None  # discover() raises when a host has none
        return chosen


class _Probe:
    """One host's probe process and a thread turning its stdout into a queue of lines."""

    def __init__(self, host: str, argv: list[str]) -> None:
        self.host = host
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def message(self, deadline: float) -> dict[str, object]:
        """The next JSON line, or :class:`DiscoveryError` naming the host and its stderr."""
        try:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = None
            why = "no answer in time"
        else:
            why = "it exited"
        if line is not None:
            try:
                return dict(json.loads(line))
            except ValueError:
                why = f"it printed {line.strip()[:200]!r}"
        self.proc.kill()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise DiscoveryError(
            f"host {self.host}: the interface probe failed ({why}){': ' + tail if tail else ''}"
        )

    def send(self, obj: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def discover(
    shell: RemoteShell,
    hosts: Sequence[str],
    port: int,
    python: str,
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float = 60.0,
) -> Discovery:
    """Probe every host (listeners on ``port``) and choose each host's interface."""
    start = time.monotonic()
    deadline = start + timeout_s
    tokens = {h: f"{h}/{secrets.token_hex(8)}" for h in hosts}
    probes = {
        h: _Probe(
            h,
            shell.argv(
                h,
                command_line(
                    cwd,
                    env,
                    [python, "-m", "longboat.launch.probe", "--port", str(port), "--token", t],
                ),
            ),
        )
        for h, t in tokens.items()
    }
    try:
        hello = {h: p.message(deadline) for h, p in probes.items()}
        for h, p in probes.items():
            p.send(
                [
                    [g, name, addr, port, tokens[g]]
                    for g in hosts
                    if g != h
                    for name, addrs in _interfaces(hello[g]).items()
                    for addr in addrs
                    if addr in dict(hello[g].get("listening", {}))  # type: ignore[call-overload]
                ]
            )
        results = {h: p.message(deadline) for h, p in probes.items()}
    finally:
        for p in probes.values():
            p.close()
        for p in probes.values():
            p.wait(timeout=5)
    return _choose(hosts, hello, results, time.monotonic() - start)


def _interfaces(hello: Mapping[str, object]) -> dict[str, list[str]]:
    return {str(k): list(v) for k, v in dict(hello.get("interfaces", {})).items()}  # type: ignore[call-overload]


def _choose(
    hosts: Sequence[str],
    hello: Mapping[str, Mapping[str, object]],
    results: Mapping[str, Mapping[str, object]],
    seconds: float,
) -> Discovery:
    """Pure: from the probes' messages, each host's reachable interfaces and its choice."""
    reached_by: dict[tuple[str, str], set[str]] = {}
    failed: dict[str, dict[str, str]] = {h: {} for h in hosts}
    for h in hosts:
        for peer, name in list(results[h].get("reached", [])):  # type: ignore[call-overload]
            reached_by.setdefault((peer, name), set()).add(h)
        for key, why in dict(results[h].get("failed", {})).items():  # type: ignore[call-overload]
            peer, name, addr = key.split(" ")
            failed[peer][f"from {h}: {name} {addr}"] = why
    networks = {}
    for h in hosts:
        interfaces = _interfaces(hello[h])
        others = set(hosts) - {h}
        good = [n for n in interfaces if reached_by.get((h, n), set()) >= others]
        networks[h] = HostNetwork(interfaces, good, good[0] if good else None, failed[h])
    lost = [h for h in hosts if networks[h].chosen is None]
    if lost:
        raise DiscoveryError("; ".join(_why_none(h, networks[h]) for h in lost))
    return Discovery(networks, seconds)


def _why_none(host: str, net: HostNetwork) -> str:
    if not net.interfaces:
        return f"host {host} has no network interface with an IPv4 address but loopback"
    tried = ", ".join(f"{k} ({why})" for k, why in sorted(net.failed.items())) or "none answered"
    return f"host {host}: no interface reached from every other host; tried {tried}"
