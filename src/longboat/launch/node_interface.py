"""A node started by hand (``--nnodes N --node-rank i``) sends gloo/NCCL where the master is.

Left alone, gloo binds to whatever this host's name resolves to (often 127.0.0.1, or a docker
bridge's address that exists on every host) and NCCL to the first interface that is not
loopback or ``docker*``; either can be an address the other nodes cannot reach, and the job then
fails in ``connectFullMesh`` or hangs. A node started by hand has no peers to probe yet (the
hostfile launcher does, see :mod:`longboat.launch.discovery`), but it knows one address every
node must reach, the master's; the interface the kernel routes that address through is the one
this node shares with node 0. A user's own ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` wins.
"""

from __future__ import annotations

from collections.abc import Mapping


def master_route_interface(master_addr: str, env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(variables to set, why) for a node of a multi-node job; ({}, why) when nothing is set."""
    from longboat.launch.doctor.network import gather, interface_of

    if env.get("GLOO_SOCKET_IFNAME") and env.get("NCCL_SOCKET_IFNAME"):
        return {}, "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME as set"
    facts = gather(master_addr)
    name = interface_of(facts.route_ip, facts.interfaces)
    if name is None:
        return {}, f"no local interface routes to the master {master_addr}; left to the backend"
    wanted = {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": "=" + name}
    chosen = {k: v for k, v in wanted.items() if not env.get(k)}
    return chosen, f"{name} ({facts.route_ip}), the interface that reaches the master {master_addr}"
