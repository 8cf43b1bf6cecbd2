"""``longboat doctor``: run every check, print the findings, return the exit status."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from longboat.launch.doctor import local, network, worker
from longboat.launch.doctor.findings import Finding, exit_code
from longboat.launch.run import LaunchUsageError, RunOptions, validate

BACKENDS = ("gloo", "nccl", "mpi")
_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red"}


@dataclass(frozen=True)
class DoctorOptions:
    """What to check: the job's shape and addresses as ``longboat run`` takes them."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    config: Path | None = None
    backend: str | None = None  # None: what longboat would pick (nccl with CUDA, else gloo)
    timeout_s: int = 60  # for the ranks to join

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def validate_options(opts: DoctorOptions) -> None:
    """Raise :class:`LaunchUsageError` for the first bad option."""
    validate(
        RunOptions(
            script=Path(worker.__file__),
            nproc_per_node=opts.nproc_per_node,
            nnodes=opts.nnodes,
            node_rank=opts.node_rank,
            master_addr=opts.master_addr,
            master_port=opts.master_port,
        )
    )
    if opts.backend is not None and opts.backend not in BACKENDS:
        raise LaunchUsageError(
            f"--backend {opts.backend!r} is not one of {', '.join(BACKENDS)}: e.g. --backend gloo"
        )
    if opts.config is not None and not opts.config.is_file():
        raise LaunchUsageError(
            f"--config {str(opts.config)!r} does not exist: give the path "
            "of a longboat TOML/JSON/YAML config"
        )
    if opts.timeout_s < 1:
        raise LaunchUsageError(
            f"--rdzv-timeout {opts.timeout_s} is invalid: give seconds, at least 1"
        )


def _backend(opts: DoctorOptions, have: local.Backends) -> str:
    """The backend asked for, else the one longboat picks (see world.default_backend)."""
    return opts.backend or ("nccl" if have.nccl and have.cuda_devices else "gloo")


def local_findings(opts: DoctorOptions) -> list[Finding]:
    """Everything checked on this machine alone."""
    have = local.backends()
    backend = _backend(opts, have)
    found = [
        local.check_versions(local.versions()),
        local.check_backend(backend, have),
        local.check_gpus_per_node(backend, opts.nproc_per_node, have),
        network.check_master(opts.master_addr, opts.master_port, opts.node_rank, opts.nnodes),
        network.check_interface(backend, opts.nnodes, os.environ, network.gather(opts.master_addr)),
        local.check_shm(local.shm_bytes()),
        local.check_config(opts.config, opts.world_size),
    ]
    return [f for f in found if f is not None]


def diagnose(opts: DoctorOptions) -> tuple[list[Finding], list[dict[str, Any]]]:
    """Local checks, then (for more than one rank) the ranks' own; findings and rank facts."""
    from longboat.launch.doctor.ranks import run_ranks

    findings = local_findings(opts)
    if opts.world_size == 1:
        return findings, []
    if any(f.status == "fail" and f.name == "master" for f in findings):
        skipped = Finding(
            "ranks",
            "warn",
            "not started: the master address or port is unusable",
            "fix the master problem above first",
        )
        return [*findings, skipped], []
    backend = _backend(opts, local.backends())
    rank_findings, facts = run_ranks(
        opts.nproc_per_node,
        opts.nnodes,
        opts.node_rank,
        opts.master_addr,
        opts.master_port,
        backend,
        opts.timeout_s,
    )
    return findings + rank_findings, facts


def render(findings: list[Finding], facts: list[dict[str, Any]], console: Console) -> None:
    """The findings table, each rank's facts, then every problem with its fix."""
    table = Table(title="longboat doctor", title_justify="left")
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    for f in findings:
        table.add_row(f.name, f"[{_STYLE[f.status]}]{f.status}[/]", escape(f.detail))
    console.print(table)
    if facts:
        ranks = Table(title="ranks", title_justify="left")
        for col in (
            "rank",
            "node",
            "host",
            "python",
            "torch",
            "longboat",
            "interface",
            "all_reduce",
        ):
            ranks.add_column(col)
        for fact in facts:
            v = fact["versions"]
            ranks.add_row(
                str(fact["rank"]),
                str(fact["node_rank"]),
                escape(fact["host"]),
                v["python"],
                v["torch"],
                v["longboat"],
                escape(str(fact["interface"])),
                f"{fact['all_reduce_ms']:.2f} ms" if fact["all_reduce_ok"] else "WRONG",
            )
        console.print(ranks)
    problems = [f for f in findings if f.status != "ok"]
    for f in problems:
        # Plain lines, never wrapped mid-word, so they can be copied and searched for.
        console.print(
            f"[{_STYLE[f.status]}]{f.status.upper()}[/] {f.name}: {escape(f.detail)}",
            soft_wrap=True,
        )
        console.print(f"  fix: {f.fix}", soft_wrap=True, highlight=False, markup=False)
    if not problems:
        console.print("[green]all checks passed[/]")


def doctor(opts: DoctorOptions, console: Console | None = None) -> int:
    """Run the preflight and print it; 0 when nothing failed, 1 otherwise. Raises
    :class:`LaunchUsageError` for bad options."""
    validate_options(opts)
    findings, facts = diagnose(opts)
    render(findings, facts, console or Console())
    return exit_code(findings)
