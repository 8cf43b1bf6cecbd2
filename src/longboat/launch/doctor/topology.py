"""``longboat doctor --hostfile``: the job's hosts as the launcher will use them.

Per host: can it run commands (the launcher's own check), how many ranks it gets, the interface
discovery picks and which peers reached it, and on accelerator hosts the device links
(``nvidia-smi topo -m``), with a warning when neighbouring local ranks (the pairs that talk most:
ring neighbours, and tensor-parallel groups of consecutive ranks) sit on the slowest link while
faster ones exist.
"""

from __future__ import annotations

import itertools
import re
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from longboat.launch.discovery import Discovery, DiscoveryError, discover
from longboat.launch.doctor.findings import Finding, exit_code
from longboat.launch.hosts import Host
from longboat.launch.shells import RemoteShell, command_line

# nvidia-smi's link kinds, fastest first (its legend): NVLink, then PCIe paths ever further.
_LINK_ORDER = ("NV", "PIX", "PXB", "PHB", "NODE", "SYS")
_TOPO_TIMEOUT_S = 30


@dataclass(frozen=True)
class HostReport:
    """What the doctor learned about one host."""

    name: str
    ranks: str  # e.g. "0-3"
    interface: str  # "eth0 (10.0.0.1)" or why none
    reached_from: str  # the peers that reached it there
    devices: str  # "no NVIDIA GPU (nvidia-smi not found)" or the matrix


def link_rank(kind: str) -> tuple[int, int]:
    """Sort key, fastest first: NVLink by its link count (NV12 before NV4), then PCIe kinds."""
    if kind.startswith("NV"):
        digits = kind[2:]
        return (0, -int(digits) if digits.isdigit() else 0)
    return (_LINK_ORDER.index(kind), 0) if kind in _LINK_ORDER else (len(_LINK_ORDER), 0)


def parse_topo(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m``'s GPU-to-GPU links: {(i, j): "NV12" | "SYS" | ...}, i < j."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    start = next((k for k, cells in enumerate(lines) if cells[0] == "GPU0"), None)
    if start is None:
        return {}
    gpus = [int(h[3:]) for h in lines[start] if re.fullmatch(r"GPU\d+", h)]
    links = {}
    for cells in lines[start + 1 :]:
        if not re.fullmatch(r"GPU\d+", cells[0]):
            break
        i = int(cells[0][3:])
        for j, kind in zip(gpus, cells[1 : 1 + len(gpus)], strict=False):
            if i < j:
                links[(i, j)] = kind
    return links


def _score(order: Sequence[int], links: dict[tuple[int, int], str]) -> list[tuple[int, int]]:
    """Neighbour links of an order, slowest first: a smaller score is a better order."""
    ranks = [link_rank(links.get((min(p), max(p)), "?")) for p in itertools.pairwise(order)]
    return sorted(ranks, reverse=True)


def neighbour_warning(host: str, slots: Sequence[int], links: dict[tuple[int, int], str]) -> str:
    """A warning when another order of the host's GPUs puts fewer neighbouring local ranks on
    slow links (local rank k runs on GPU ``slots[k]``; ranks k and k + 1 are ring neighbours
    and share tensor-parallel groups, so they are the pairs that talk most)."""
    if len(slots) < 2 or len(slots) > 8 or not links:  # 8! orders at most
        return ""
    best = min(itertools.permutations(slots), key=lambda o: _score(o, links))
    if _score(slots, links) <= _score(best, links):
        return ""
    kinds = {p: links.get((min(p), max(p)), "?") for p in itertools.pairwise(slots)}
    slowest = max(kinds.values(), key=link_rank)
    bad = ", ".join(f"GPU{a}-GPU{b}" for (a, b), k in kinds.items() if k == slowest)
    return (
        f"{host}: neighbouring ranks on {bad} talk over {slowest}; the order "
        f"CUDA_VISIBLE_DEVICES={','.join(map(str, best))} puts neighbours on faster links"
    )


def _devices(shell: RemoteShell, host: str, cwd: Path) -> tuple[str, dict[tuple[int, int], str]]:
    argv = shell.argv(
        host, command_line(cwd, {}, ["sh", "-c", "command -v nvidia-smi && nvidia-smi topo -m"])
    )
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=_TOPO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"nvidia-smi topo -m did not answer in {_TOPO_TIMEOUT_S} s", {}
    if out.returncode != 0 and not out.stdout.strip():
        return "no NVIDIA GPU (nvidia-smi not found)", {}
    text = "\n".join(out.stdout.splitlines()[1:])  # after `command -v`'s path
    return text.strip() or out.stderr.strip(), parse_topo(text)


def survey(
    shell: RemoteShell,
    hosts: Sequence[Host],
    port: int,
    python: str,
    cwd: Path,
    env: dict[str, str],
) -> tuple[list[Finding], list[HostReport]]:
    """Check, discover and list every host (nothing is left running afterwards)."""
    from longboat.launch.multihost import check_hosts

    names = [h.name for h in hosts]
    findings: list[Finding] = []
    unreachable = check_hosts(shell, names)
    for h in names:
        if h in unreachable:
            findings.append(
                Finding(
                    f"host {h}",
                    "fail",
                    unreachable[h],
                    f"make `{' '.join(shell.check_argv(h, 10))}` succeed, or leave the host "
                    "out with --exclude",
                )
            )
        else:
            findings.append(Finding(f"host {h}", "ok", f"runs commands through {shell.name}"))
    found: Discovery | None = None
    if not unreachable and len(names) > 1:
        try:
            found = discover(shell, names, port, python, cwd, env)
        except DiscoveryError as e:
            findings.append(
                Finding(
                    "interfaces",
                    "fail",
                    str(e),
                    "the hosts need one network on which each reaches every other; open "
                    f"--master-port {port} between them, or fix the routes",
                )
            )
        else:
            findings.append(Finding("interfaces", "ok", f"found in {found.seconds:.1f} s"))
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        devices = dict(
            zip(
                names,
                pool.map(
                    lambda h: ("", {}) if h in unreachable else _devices(shell, h, cwd), names
                ),
                strict=True,
            )
        )
    reports = []
    first = 0
    for host in hosts:
        text, links = devices.get(host.name, ("unreachable", {}))
        warning = neighbour_warning(host.name, host.slots, links)
        if warning:
            findings.append(Finding(f"devices {host.name}", "warn", warning, "see the detail"))
        net = found.hosts.get(host.name) if found else None
        if net is not None:
            skipped = [n for n in net.interfaces if n not in net.reachable]
            iface = f"{net.chosen} ({net.address})" + (
                f"; skipped {', '.join(skipped)}" if skipped else ""
            )
            peers = ", ".join(n for n in names if n != host.name) or "-"
        else:
            iface = "127.0.0.1 (one host)" if len(names) == 1 else "not probed"
            peers = "-"
        reports.append(
            HostReport(
                host.name, f"{first}-{first + host.nproc - 1}", iface, peers, text or "unknown"
            )
        )
        first += host.nproc
    return findings, reports


def render(findings: list[Finding], reports: list[HostReport], console: Console) -> None:
    """The hosts table, each accelerator host's device links, then the findings."""
    from longboat.launch.doctor.preflight import render as render_findings

    table = Table(title="hosts", title_justify="left")
    for col in ("host", "ranks", "interface", "reached from", "devices"):
        table.add_column(col, overflow="fold")
    for r in reports:
        first = r.devices.splitlines()[0] if r.devices else ""
        table.add_row(*(escape(v) for v in (r.name, r.ranks, r.interface, r.reached_from, first)))
    console.print(table)
    for r in reports:
        if "\n" in r.devices:
            console.print(f"{escape(r.name)}: nvidia-smi topo -m", highlight=False)
            console.print(r.devices, markup=False, highlight=False)
    render_findings(findings, [], console)


def doctor_hosts(
    hosts: Sequence[Host], shell: RemoteShell, port: int, console: Console | None = None
) -> int:
    """``longboat doctor --hostfile``: survey the hosts and print it; 1 when a check failed."""
    import os
    import sys

    from longboat.launch.forward_env import forwarded

    cwd = Path.cwd()
    findings, reports = survey(shell, hosts, port, sys.executable, cwd, forwarded(os.environ, cwd))
    render(findings, reports, console or Console())
    return exit_code(findings)
