"""``longboat horovodrun``: Horovod's launcher command line, run by ``longboat run``.

``horovodrun -np 4 -H a:2,b:2 python train.py`` becomes ``longboat run -H a:2,b:2 train.py``
(``-np 4 python train.py`` alone: ``longboat run -n 4 train.py``). As with Horovod, ``-np`` ranks
fill the hosts' slots in order; ``--network-interface`` becomes ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME``; ``-p``/``-i`` are ssh's port and key. A script's import stays
``import longboat.horovod.torch as hvd``. Horovod's MPI and its elastic host discovery have no
counterpart and are refused by name.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from longboat.cli.app import app, usage_error
from longboat.cli.hostopts import parse_hosts

if TYPE_CHECKING:
    from longboat.launch.hosts import Host


@app.command(
    "horovodrun",
    context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True},
)
def horovodrun(
    command: list[str] = typer.Argument(..., metavar="COMMAND", help="python SCRIPT ARGS..."),
    num_proc: int = typer.Option(..., "-np", "--num-proc", help="ranks in all"),
    hosts: str | None = typer.Option(None, "-H", "--hosts", help="host:slots,..."),
    hostfile: Path | None = typer.Option(None, "--hostfile", help="`host slots=N` lines"),
    ssh_port: int | None = typer.Option(None, "-p", "--ssh-port", help="sshd's port"),
    ssh_identity_file: Path | None = typer.Option(
        None, "-i", "--ssh-identity-file", help="ssh's private key"
    ),
    network_interface: str | None = typer.Option(
        None, "--network-interface", "--nics", help="the interface(s) gloo and NCCL use"
    ),
    start_timeout: int | None = typer.Option(
        None, "--start-timeout", help="seconds for every rank to start (the rendezvous timeout)"
    ),
    gloo: bool = typer.Option(False, "--gloo", help="accepted: longboat always runs on gloo/NCCL"),
    mpi: bool = typer.Option(False, "--mpi", help="refused: longboat does not run on MPI"),
    verbose: bool = typer.Option(False, "--verbose", help="accepted"),
    host_discovery_script: Path | None = typer.Option(
        None, "--host-discovery-script", help="refused: a longboat job's hosts are fixed"
    ),
) -> None:
    """Run a Horovod job with Horovod's flags (`longboat horovodrun -np 2 python train.py`)."""
    if mpi:
        raise usage_error("--mpi: longboat runs on gloo (CPU) and NCCL (GPU); drop --mpi")
    if host_discovery_script is not None:
        raise usage_error(
            "--host-discovery-script: a longboat job has fixed hosts (it restarts, with "
            "--max-restarts, rather than growing); give them with -H or --hostfile"
        )
    if num_proc < 1:
        raise usage_error(f"-np {num_proc} is invalid: give 1 or more ranks")
    script, args = _script(command)
    argv = [sys.executable, "-m", "longboat.cli", "run"]
    found = parse_hosts(hostfile, hosts)
    if found is not None:
        argv += ["-H", _fill(found, num_proc)]
    else:
        argv += ["-n", str(num_proc)]
    if ssh_port is not None:
        argv += ["--ssh-port", str(ssh_port)]
    if ssh_identity_file is not None:
        argv += ["--ssh-option", f"IdentityFile={ssh_identity_file}"]
    if start_timeout is not None:
        argv += ["--rdzv-timeout", str(start_timeout)]
    if network_interface:
        os.environ["GLOO_SOCKET_IFNAME"] = network_interface
        os.environ["NCCL_SOCKET_IFNAME"] = network_interface
    os.execv(sys.executable, [*argv, script, *args])


def _script(command: list[str]) -> tuple[str, list[str]]:
    """``python [-u] train.py args`` -> (train.py, args); a bare ``train.py`` is taken too."""
    words = list(command)
    if words and Path(words[0]).name.startswith("python"):
        words = words[1:]
        while words and words[0].startswith("-") and words[0] in ("-u", "-B", "-O", "-OO"):
            words = words[1:]
    if not words or not words[0].endswith(".py"):
        raise usage_error(
            f"horovodrun COMMAND {' '.join(command)!r}: longboat runs Python scripts; give "
            "`python train.py ARGS` (a module, -m, is not supported)"
        )
    return words[0], words[1:]


def _fill(found: Sequence[Host], num_proc: int) -> str:
    """Horovod's placement: ``num_proc`` ranks fill the hosts' slots in order."""
    total = sum(h.nproc for h in found)
    if num_proc > total:
        raise usage_error(
            f"-np {num_proc} is more than the {total} slots of the hosts "
            f"({', '.join(f'{h.name}:{h.nproc}' for h in found)}); lower -np or add slots"
        )
    parts, left = [], num_proc
    for h in found:
        take = min(h.nproc, left)
        if take:
            parts.append(f"{h.name}:{take}")
        left -= take
    return ",".join(parts)
