"""What every benchmark records and needs: a free loopback port, a gloo group on it, versions,
the machine."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from longboat.bench import report
from longboat.world import before_group


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(rank: int, world_size: int, port: int, **env: str) -> None:
    """The variables torchrun would set for ``rank`` of ``world_size`` ranks meeting on
    127.0.0.1:``port`` (``env`` adds others), so ``longboat.initialize`` finds the job."""
    n = str(world_size)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=n,
        LOCAL_WORLD_SIZE=n,
        **env,
    )
    if sys.platform.startswith("linux"):
        # Pin gloo to loopback: by default it resolves the hostname, which on some machines
        # names an interface the other ranks cannot reach.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def join_loopback(
    rank: int, world_size: int, port: int, threads: int, timeout_s: float | None = None, **env: str
) -> None:
    """Join a gloo group of ``world_size`` ranks meeting on 127.0.0.1:``port`` as ``rank``.

    Sets the variables torchrun would, so ``longboat.initialize`` finds the job and reuses the
    group opened here (``env`` adds others), and runs ``threads`` torch threads."""
    loopback_env(rank, world_size, port, **env)
    torch.set_num_threads(threads)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    before_group()  # so that leaving the group ends gloo's threads before the exit
    dist.init_process_group("gloo", rank=rank, world_size=world_size, **timeout)


def fresh_job(job: Callable[..., None], nprocs: int, *args: Any) -> dict[str, Any]:
    """Run ``job(rank, *args, port, out)`` in ``nprocs`` fresh processes meeting on a free
    loopback port; return the JSON one of them wrote to ``out``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "job.json")
        mp.spawn(job, args=(*args, free_port(), out), nprocs=nprocs)
        result: dict[str, Any] = json.loads(Path(out).read_text())
        return result


def package_version(dist_name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def commit() -> str | None:
    """The commit the benchmark ran at, with ``+dirty`` when the work tree had changes."""
    from longboat.bench.report import source_commit

    return source_commit(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def versions(*extra: str) -> dict[str, str | None]:
    """Python, torch, longboat and platform versions, the commit, plus the versions of ``extra``
    distributions."""
    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "longboat": package_version("longboat"),
        "commit": commit(),
    }
    out.update({name: package_version(name) for name in extra})
    out["platform"] = platform.platform()
    return out


def machine() -> dict[str, object]:
    """The machine a result was measured on (no hostname)."""
    return report.machine()
