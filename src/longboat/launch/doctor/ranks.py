"""The part of the preflight that needs every rank: start them as ``longboat run`` would, and
judge what they report (versions must match, the group must form and compute)."""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from longboat.launch.doctor import worker
from longboat.launch.doctor.findings import Finding
from longboat.launch.run import LaunchUsageError, RunOptions, launch


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def compare_ranks(facts: list[dict[str, Any]]) -> list[Finding]:
    """Findings from every rank's facts: matching versions and a correct all_reduce."""
    findings = []
    for key in facts[0]["versions"]:
        by_value: dict[str, list[int]] = defaultdict(list)
        for f in facts:
            by_value[str(f["versions"].get(key))].append(f["rank"])
        if len(by_value) > 1:
            common = max(by_value, key=lambda v: len(by_value[v]))
            spread = "; ".join(f"{value} on {_ranks_text(r)}" for value, r in by_value.items())
            hosts = sorted({f["host"] for f in facts if str(f["versions"].get(key)) != common})
            findings.append(
                Finding(
                    f"{key} version",
                    "fail",
                    f"{key} differs between ranks: {spread}",
                    f"install the same {key} everywhere, e.g. {key} {common} on {', '.join(hosts)}",
                )
            )
    if not findings:
        names = ", ".join(facts[0]["versions"])
        findings.append(
            Finding("rank versions", "ok", f"{names} the same on all {len(facts)} ranks")
        )
    bad = [f["rank"] for f in facts if not f.get("all_reduce_ok")]
    slowest = max(float(f.get("all_reduce_ms", 0.0)) for f in facts)
    if bad:
        findings.append(
            Finding(
                "all_reduce",
                "fail",
                f"wrong all_reduce result on {_ranks_text(bad)}",
                "the group formed but computes wrongly: report it with this output",
            )
        )
    else:
        findings.append(
            Finding(
                "all_reduce",
                "ok",
                f"{len(facts)} ranks joined gloo; all_reduce correct, "
                f"{slowest:.2f} ms (slowest rank)",
            )
        )
    return findings


def _join_failure(detail: str, master_addr: str, port: int | None) -> Finding:
    where = f"{master_addr}:{port}" if port else master_addr
    return Finding(
        "ranks",
        "fail",
        detail,
        f"check that every node runs the same command with its own --node-rank, that "
        f"{where} is node 0's address on the network the nodes share, that the "
        "firewall lets the port and gloo's connections through, and that "
        "GLOO_SOCKET_IFNAME names that network's interface",
    )


def run_ranks(
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    backend: str,
    timeout_s: int,
) -> tuple[list[Finding], list[dict[str, Any]]]:
    """Start this node's ranks with the doctor worker; return findings and every rank's facts
    (empty when the group did not form)."""
    with tempfile.TemporaryDirectory(prefix="longboat-doctor-") as tmp:
        out = Path(tmp)
        opts = RunOptions(
            script=Path(worker.__file__),
            script_args=(str(out), str(timeout_s), backend),
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            rdzv_timeout_s=timeout_s,
            grace_period_s=5,
        )
        try:
            code = launch(opts)
        except LaunchUsageError as e:
            return [_join_failure(str(e), master_addr, master_port)], []
        errors = sorted(out.glob("error-rank*.json"))
        if errors or code != 0 or not (out / "ranks.json").exists():
            said = [json.loads(p.read_text()) for p in errors]
            detail = (
                "; ".join(f"rank {e['rank']}: {e['error']}" for e in said)
                or f"the ranks did not all join within {timeout_s} s (exit {code})"
            )
            return [_join_failure(detail, master_addr, master_port)], []
        facts = json.loads((out / "ranks.json").read_text())
    return compare_ranks(facts), facts
