"""This host's network as the job sees it: listening sockets, routes, interfaces.

Kept free of torch (usage errors and the launcher's checks stay fast) and low in the layers, so
the workers' process-group set-up (:mod:`longboat.world`) and the launcher share one answer to
"which address, which interface".
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

# The variable each backend reads to choose its network interface.
IFNAME_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
# Host names by node rank, comma-separated: set for every node by the hostfile launcher, read by
# the reports that name a node (rendezvous failures, lost hosts).
HOSTS_VAR = "LONGBOAT_HOSTS"


# [Note: listeners] torch's stores and backends have no authentication, so every socket a job
# listens on must sit on the address the user chose (loopback on one machine), never on the
# wildcard. Three kinds of listener and what keeps each there:
# * the TCPStore: given a host and port it listens on every interface whatever the host; a
#   socket bound first (bind_listener) and handed over as ``master_listen_fd`` does not;
# * gloo's pairs: each rank listens on its device's address, which is the interface named by
#   GLOO_SOCKET_IFNAME, else whatever the hostname resolves to (often an address of the LAN);
# * NCCL's bootstrap: NCCL_SOCKET_IFNAME, else the first interface that is not loopback.
# So every group longboat opens gets a pre-bound store and the interface variables of the
# route to its master (master_route_interface; on one machine that route is loopback).


def bind_listener(addr: str, port: int) -> socket.socket:
    """Bind and listen on ``addr:port`` (port 0: a free one); raise ``OSError`` if impossible.

    Handing the bound socket to ``TCPStore`` (``master_listen_fd``) makes the store listen only
    on ``addr`` (given a host and port, torch's store listens on every interface whatever the
    host), and leaves no window in which another process could take a port found free.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to, in order, without duplicates ([] when it does not)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def route_ip(addr: str) -> str | None:
    """The local address used to reach ``addr``: a UDP connect sends nothing, but makes the
    kernel pick the route, whose source address getsockname then tells."""
    ips = resolve(addr)
    if not ips:
        return None
    family = socket.AF_INET6 if ":" in ips[0] else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((ips[0], 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IP addresses (IPv4 and IPv6, zone suffixes dropped)."""
    import psutil

    return {
        name: [
            a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)
        ]
        for name, addrs in psutil.net_if_addrs().items()
    }


def interface_of(ip: str | None, found: Mapping[str, list[str]]) -> str | None:
    """The interface that owns ``ip``."""
    for name, addrs in found.items():
        if ip in addrs:
            return name
    return None


def master_route_interface(master_addr: str, env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The interface variables for a process of a job, and why ([Note: listeners]).

    Left alone, gloo binds to whatever the host's name resolves to (often 127.0.0.1, or a docker
    bridge's address that exists on every host) and NCCL to the first interface that is not
    loopback or ``docker*``; either can be an address the other nodes cannot reach, and the job
    then fails in ``connectFullMesh`` or hangs. Every node must reach the master, so the
    interface the kernel routes the master's address through is one this node shares with node
    0. Variables the user set are kept: only the missing ones are returned.
    """
    if all(env.get(v) for v in IFNAME_VARS.values()):
        return {}, "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME as set"
    via = route_ip(master_addr)
    name = interface_of(via, interfaces())
    if name is None:
        return {}, f"no local interface routes to the master {master_addr}; left to the backend"
    wanted = {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": "=" + name}  # "=": exact name
    chosen = {k: v for k, v in wanted.items() if not env.get(k)}
    return chosen, f"{name} ({via}), the interface that reaches the master {master_addr}"


def node_label(node: int, env: Mapping[str, str] | None = None) -> str:
    """``host h1 (node 1)`` where the hostfile launcher named the hosts, else ``node 1``."""
    env = os.environ if env is None else env
    hosts = [h for h in env.get(HOSTS_VAR, "").split(",") if h]
    return f"host {hosts[node]} (node {node})" if 0 <= node < len(hosts) else f"node {node}"
