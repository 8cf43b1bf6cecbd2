"""Checks about the network: the master address and port, and the interface the backend uses.

The facts (interfaces, the route to the master, what the hostname resolves to) are gathered by
:func:`gather` and judged by pure functions, so tests can inject any machine's facts.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from longboat.launch.doctor.findings import Finding
from longboat.network import IFNAME_VARS, bind_listener, interface_of, interfaces, route_ip
from longboat.network import resolve as _resolve


@dataclass(frozen=True)
class NetFacts:
    """What this host's network looks like, as far as the backend's choice goes."""

    interfaces: dict[str, list[str]]  # name -> IP addresses
    route_ip: str | None  # the local address that packets to the master leave from
    hostname: str
    hostname_ips: list[str]  # what the hostname resolves to (gloo's default choice)


def gather(master_addr: str) -> NetFacts:
    """Read this host's interfaces and routes (no packet is sent)."""
    hostname = socket.gethostname()
    return NetFacts(
        interfaces=interfaces(),
        route_ip=route_ip(master_addr),
        hostname=hostname,
        hostname_ips=_resolve(hostname),
    )


def _is_loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def _listing(interfaces: Mapping[str, list[str]]) -> str:
    return ", ".join(
        f"{name} ({', '.join(addrs) or 'no address'})" for name, addrs in interfaces.items()
    )


def _best_interface(facts: NetFacts) -> str | None:
    """The interface to recommend: the one on the route to the master, else the first
    non-loopback one with an address."""
    routed = interface_of(facts.route_ip, facts.interfaces)
    if routed and not (facts.route_ip and _is_loopback(facts.route_ip)):
        return routed
    for name, addrs in facts.interfaces.items():
        if addrs and not all(_is_loopback(a) for a in addrs):
            return name
    return routed


def _missing_names(var_value: str, backend: str, interfaces: Mapping[str, list[str]]) -> list[str]:
    """Names in the interface variable that match no interface here.

    Gloo takes a comma-separated list of exact names. NCCL takes prefixes, ``=name`` for an
    exact name and a leading ``^`` to exclude; an exclusion list names nothing that must exist.
    """
    value = var_value.strip()
    if backend == "nccl" and value.startswith("^"):
        return []
    exact = backend != "nccl"
    if backend == "nccl" and value.startswith("="):
        exact, value = True, value[1:]
    names = [n.strip() for n in value.split(",") if n.strip()]
    if exact:
        return [n for n in names if n not in interfaces]
    return [n for n in names if not any(i.startswith(n) for i in interfaces)]


def backend_interface(
    backend: str, env: Mapping[str, str], facts: NetFacts
) -> tuple[str | None, str]:
    """The interface the backend will use and why (None when it cannot be told)."""
    var = IFNAME_VARS.get(backend)
    if var and env.get(var):
        first = env[var].lstrip("=").split(",")[0].strip()
        if not env[var].startswith("^"):
            match = (
                first
                if first in facts.interfaces
                else next((i for i in facts.interfaces if i.startswith(first)), None)
            )
            return match, f"{var}={env[var]}"
    if backend == "gloo":
        # Gloo binds to the first address the hostname resolves to, else to loopback.
        for ip in facts.hostname_ips:
            name = interface_of(ip, facts.interfaces)
            if name:
                return name, f"hostname {facts.hostname} -> {ip}"
        lo = next((n for n, a in facts.interfaces.items() if any(map(_is_loopback, a))), None)
        return lo, f"hostname {facts.hostname} resolves to no local address; loopback fallback"
    if backend == "nccl":
        # NCCL prefers InfiniBand, then any interface other than loopback and docker bridges.
        usable = [
            n
            for n, a in facts.interfaces.items()
            if a and not n.startswith(("lo", "docker")) and not all(map(_is_loopback, a))
        ]
        ib = [n for n in usable if n.startswith("ib")]
        pick = (ib or usable)[:1]
        return (pick[0] if pick else None), "NCCL's default choice"
    return None, f"{backend} chooses for itself"


def check_interface(backend: str, nnodes: int, env: Mapping[str, str], facts: NetFacts) -> Finding:
    """Does the backend's interface exist, and (with several nodes) reach the master?"""
    var = IFNAME_VARS.get(backend)
    best = _best_interface(facts)
    export = f"export {var}={best}" if var and best else ""
    if var and env.get(var):
        missing = _missing_names(env[var], backend, facts.interfaces)
        if missing:
            return Finding(
                "interface",
                "fail",
                f"{var}={env[var]} names no interface here ({', '.join(missing)}); this host "
                f"has: {_listing(facts.interfaces)}",
                (
                    f"{export} (the interface that reaches the master)"
                    if export
                    else f"set {var} to one of: {', '.join(facts.interfaces)}"
                )
                + f", or unset {var}",
            )
    used, why = backend_interface(backend, env, facts)
    routed = interface_of(facts.route_ip, facts.interfaces)
    detail = (
        f"{backend} would use {used or '?'} ({why}); master reached via "
        f"{routed or '?'} ({facts.route_ip or 'no route'})"
    )
    if nnodes > 1 and var:
        loop = used is not None and all(map(_is_loopback, facts.interfaces.get(used, [])))
        if loop:
            return Finding(
                "interface",
                "warn",
                detail + "; loopback cannot reach other nodes",
                export or f"set {var} to the interface that reaches the other nodes",
            )
        if (
            used
            and routed
            and used != routed
            and not (facts.route_ip and _is_loopback(facts.route_ip))
        ):
            return Finding(
                "interface",
                "warn",
                detail + "; they differ",
                f"{export} if the nodes talk over {routed}",
            )
    return Finding("interface", "ok", detail)


def check_master(addr: str, port: int | None, node_rank: int, nnodes: int = 1) -> Finding:
    """Node 0 must be able to listen on ``addr:port``; other nodes must reach it."""
    ips = _resolve(addr)
    if not ips:
        return Finding(
            "master",
            "fail",
            f"--master-addr {addr} does not resolve",
            "give node 0's IP address or a hostname every node can resolve",
        )
    if nnodes > 1 and all(map(_is_loopback, ips)):
        return Finding(
            "master",
            "fail",
            f"--master-addr {addr} is a loopback address, which other nodes cannot "
            f"reach (--nnodes {nnodes})",
            "give node 0's address on the network the nodes share, e.g. the one "
            "`hostname -I` prints on node 0",
        )
    shown = f"{addr}:{port if port is not None else '(free port)'}"
    if node_rank == 0:
        try:
            sock = bind_listener(addr, port or 0)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return Finding(
                    "master",
                    "fail",
                    f"port {port} on {addr} is already in use",
                    f"pick another --master-port (e.g. {_free_port(addr)}), or leave "
                    "it out on a single node to get a free one; `ss -ltnp "
                    f"'sport = :{port}'` shows who holds it",
                )
            return Finding(
                "master",
                "fail",
                f"cannot listen on {addr} here ({e.strerror or e})",
                "node 0 hosts the rendezvous: give an address of this machine as "
                "--master-addr (127.0.0.1 on one machine)",
            )
        sock.close()
        return Finding("master", "ok", f"{shown} resolves, is local and free to listen on")
    try:
        with socket.create_connection((ips[0], port or 0), timeout=3):
            pass
    except OSError as e:
        return Finding(
            "master",
            "warn",
            f"{shown} not reachable now ({e.strerror or e})",
            "start node 0 first; if it runs, open the port in the firewall or give "
            "node 0's address on the network the nodes share",
        )
    return Finding("master", "ok", f"{shown} reachable")


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
