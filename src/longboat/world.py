"""Who am I: rank, local rank, world size and node, read from the environment; process groups.

Sources, in order: torchrun / ``longboat run`` (``RANK``, ``WORLD_SIZE``), Slurm (``SLURM_PROCID``
under ``srun``), Open MPI (``OMPI_COMM_WORLD_*``), else a plain single process. Nothing here is a
module-level global: a :class:`World` is created once and passed along.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from longboat.config.errors import ConfigError
from longboat.heap import limit_arenas

# Slurm's node list and port rules live with the launcher's, in a module free of torch;
# first_host stays importable from here.
from longboat.launch.node_env import first_host as first_host
from longboat.launch.node_env import slurm_master_addr, slurm_master_port
from longboat.network import bind_listener, master_route_interface

if TYPE_CHECKING:
    # torch.distributed re-exports TCPStore without marking it public (no ``as``, no __all__).
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class World:
    """The position of this process in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    source: str = "single process"

    @property
    def is_main(self) -> bool:
        """True on global rank 0, which logs and holds the progress bar."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> World:
        """Detect the world from environment variables (see the module docstring)."""
        env = os.environ if env is None else env
        if "RANK" in env and "WORLD_SIZE" in env:
            return _from_torchrun(env)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env:
            return _from_slurm(env)
        if "OMPI_COMM_WORLD_RANK" in env:
            return _from_openmpi(env)
        return cls()

    def env_vars(self) -> dict[str, str]:
        """The torchrun-style variables that ``init_method='env://'`` reads."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(
            f"environment variable {key}={env[key]!r} is not an integer; fix the launcher "
            "that set it"
        ) from None


def _check(w: World) -> World:
    if not 0 <= w.rank < w.world_size:
        raise ValueError(f"rank {w.rank} is outside world size {w.world_size} ({w.source})")
    if not 0 <= w.local_rank < w.local_world_size:
        raise ValueError(
            f"local rank {w.local_rank} is outside local world size {w.local_world_size} "
            f"({w.source})"
        )
    return w


def _from_torchrun(env: Mapping[str, str]) -> World:
    world_size = _int(env, "WORLD_SIZE")
    local_world = int(env.get("LOCAL_WORLD_SIZE", world_size))
    rank = _int(env, "RANK")
    node = int(env.get("GROUP_RANK", rank // max(local_world, 1)))
    return _check(
        World(
            rank=rank,
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=world_size,
            local_world_size=local_world,
            node_rank=node,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            source="torchrun environment",
        )
    )


def _from_slurm(env: Mapping[str, str]) -> World:
    ntasks = _int(env, "SLURM_NTASKS")
    nnodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", 1)))
    local_world = int(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or ntasks // nnodes)
    return _check(
        World(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=ntasks,
            local_world_size=local_world,
            node_rank=int(env.get("SLURM_NODEID", 0)),
            master_addr=slurm_master_addr(env),
            # The port `longboat run` derives too, when srun starts it once per node.
            master_port=slurm_master_port(env),
            source="Slurm environment",
        )
    )


def _from_openmpi(env: Mapping[str, str]) -> World:
    local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    return _check(
        World(
            rank=rank,
            local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
            world_size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_world_size=local_world,
            node_rank=int(env.get("OMPI_COMM_WORLD_NODE_RANK", rank // max(local_world, 1))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            source="Open MPI environment",
        )
    )


def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def device_for(world: World) -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", world.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(
    world: World, backend: str | None = None, timeout_s: float = 1800.0, store_prefix: str = ""
) -> bool:
    """Join the default process group unless one exists. Returns True when this call created it.

    A script that called ``torch.distributed.init_process_group`` itself (torchrun style) keeps
    its group; a world of one needs no group at all. ``store_prefix``: a namespace in the
    launcher's store for a group that replaces an earlier one in the same processes (the
    earlier group's rendezvous keys, which name its closed ports, stay in that store: joined
    again without a new namespace, gloo dials them and fails with "Connection refused").
    """
    if not world.distributed or dist.is_initialized():
        return False
    backend = backend if backend not in (None, "auto") else default_backend()
    before_group()
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if backend == "nccl" and world.local_world_size > gpus:
            # NCCL refuses two ranks on one GPU only at the first collective, as "invalid
            # usage" (seen on a lent one-GPU machine); say so before, on every rank.
            raise ConfigError(
                f"{world.local_world_size} ranks on this node and {gpus} GPU(s): NCCL needs a "
                f"GPU of its own for each rank. Start at most {gpus} rank(s) per node, or set "
                "comm.backend = 'gloo' to let ranks share a GPU (slower)"
            )
        # Every rank's current device is its own, for gloo too: CUDA tensors it allocates
        # without naming a device, and the caching allocator's streams, are then this rank's.
        torch.cuda.set_device(device_for(world))
    if backend != "nccl":  # before gloo's worker threads exist: [Note: one arena] in heap.py
        limit_arenas()
    timeout = datetime.timedelta(seconds=timeout_s)
    # Under torchrun / longboat run the agent serves the store at MASTER_PORT
    # (TORCHELASTIC_USE_AGENT_STORE) and chose the interface: env:// joins it. Started otherwise
    # (srun, mpirun, by hand), rank 0 serves the store itself: see _own_store.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        if store_prefix:
            from torch.distributed import PrefixStore, rendezvous  # type: ignore[attr-defined]

            url = f"env://?rank={world.rank}&world_size={world.world_size}"
            store, _, _ = next(rendezvous(url, timeout=timeout))
            dist.init_process_group(
                backend=backend,
                store=PrefixStore(store_prefix, store),
                rank=world.rank,
                world_size=world.world_size,
                timeout=timeout,
            )
            return True
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=world.rank,
            world_size=world.world_size,
            timeout=timeout,
        )
        return True
    # Variables a launcher set win; Slurm and Open MPI runs get theirs filled in from `world`.
    for key, value in world.env_vars().items():
        os.environ.setdefault(key, value)
    # One node or several: gloo's pairs listen on the route to the master ([Note: listeners]).
    chosen, _ = master_route_interface(world.master_addr, os.environ)
    os.environ.update(chosen)
    dist.init_process_group(
        backend=backend,
        store=_own_store(world, timeout),
        rank=world.rank,
        world_size=world.world_size,
        timeout=timeout,
    )
    return True


def _own_store(world: World, timeout: datetime.timedelta) -> TCPStore:
    """The job's store, served by rank 0 on MASTER_ADDR:MASTER_PORT only.

    torch's env:// store listens on every interface whatever MASTER_ADDR says; a socket bound
    to MASTER_ADDR and handed over (``master_listen_fd``) keeps it on the job's network. When
    MASTER_ADDR is not an address of rank 0's host (a service name in front of it), the store
    falls back to torch's own listener.
    """
    return bound_store(
        world.master_addr, world.master_port, world.rank, world.world_size, timeout, strict=False
    )


def bound_store(
    addr: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    *,
    strict: bool = True,
) -> TCPStore:
    """A store for ``world_size`` ranks that rank 0 serves on ``addr:port`` and nowhere else.

    Every group longboat opens gets its store here (``init_process_group(store=...)``): the
    job's own, and those that ``longboat bench``, ``longboat tune`` and the test pool open for
    their ranks on 127.0.0.1. Given only a host and port, torch's store listens on every
    interface, unauthenticated, for as long as the group lives; a socket bound to ``addr``
    first and handed over (``master_listen_fd``) is the only way to keep it there. ``strict``
    False lets the store fall back to torch's own listener when ``addr`` is not an address of
    this host (a service name in front of it, see :func:`_own_store`); the tools, which
    always serve on loopback, keep it True, so a failed bind is an error, never a wildcard.
    """
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # see the import above

    if rank != 0:
        return TCPStore(addr, port, world_size, False, timeout, multi_tenant=True)
    try:
        fd: int | None = bind_listener(addr, port).detach()
    except OSError:
        if strict:
            raise
        fd = None
    return TCPStore(addr, port, world_size, True, timeout, multi_tenant=True, master_listen_fd=fd)


# [Note: dynamo before the group] Importing ``torch._dynamo`` while a default process group
# exists leaves about a dozen references to the group's Python object behind it (measured with
# torch 2.13: the refcount goes from 9 to 20), and torch imports it on the first optimizer a
# script builds. ``destroy_process_group`` then unregisters the group but cannot free it, so a
# gloo group's worker threads live on into interpreter shutdown, where a worker that touches a
# Python object aborts the process ("terminate called without an active exception", the rank
# killed by SIGABRT after a finished run; seen in about 1 of 20 Horovod-style runs). Imported
# before the group is created, dynamo holds nothing of it and ``destroy_process_group`` ends its
# threads (test_world.py::test_leaving_the_group_ends_its_threads_after_an_optimizer_was_built).
# A group a script creates itself (``dist.init_process_group``, then its first optimizer) is
# kept the same way, whoever destroys it; :func:`before_group` before creating it avoids that,
# and the benchmarks and ``longboat bench``'s ranks call it.


def before_group() -> None:
    """Call before creating a process group with ``torch.distributed`` directly, so that
    destroying it later ends its threads ([Note: dynamo before the group]);
    :func:`init_process_group` calls it itself."""
    import torch._dynamo  # noqa: F401 (imported for its side effect, before the group)


def destroy_process_group() -> None:
    """Leave the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()
