"""Parameter servers: workers push gradients to dedicated server ranks and pull parameters back,
in ``sync``, ``async`` or ``ssp`` (bounded staleness) mode.

Through the engine: ``strategy = "parameter_server"`` and a ``[parameter_server]`` section
(``longboat.ps.worker``). Directly: :func:`connect` gives a worker MXNet's
:class:`KVStore`; on a server rank it serves and ends the process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from longboat.ps.client import Connection, KVStore, ServerAbort, ServerLost
from longboat.ps.service import ServerExit

#: MXNet's KVStore types and their modes here.
KVSTORE_TYPES = {"dist_sync": "sync", "dist_sync_device": "sync", "dist_async": "async"}


def connect(
    kind: str = "dist_sync",
    *,
    servers: int = 1,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    staleness: int = 2,
    heartbeat_s: float = 1.0,
    dead_after_s: float = 10.0,
    timeout_s: float = 1800.0,
) -> KVStore:
    """Join a parameter-server job as MXNet's ``mx.kv.create(kind)`` does: ``dist_sync``,
    ``dist_async`` or ``ssp``. The last ``servers`` ranks serve (``optimizer(tensors)`` builds
    the optimizer they apply pushes with; None: a push replaces nothing and pulls return the
    mean gradient, sync only) and end their process when the workers leave; the others get
    a :class:`KVStore`. Joins the process group from the environment if needed."""
    from longboat.config.loading import load_config
    from longboat.strategies.registry import build_service
    from longboat.world import World, init_process_group

    mode = KVSTORE_TYPES.get(kind, kind)
    cfg = load_config(
        {
            "strategy": "parameter_server",
            "parameter_server": {
                "servers": servers,
                "mode": mode,
                "staleness": staleness,
                "update_on_server": optimizer is not None,
                "heartbeat_s": heartbeat_s,
                "dead_after_s": dead_after_s,
            },
        }
    )
    world = World.from_env()
    init_process_group(world, timeout_s=timeout_s)
    service = build_service(cfg, world.world_size)
    service.start(timeout_s)
    if service.serves(world.rank):
        service.serve_with(_factory(optimizer))
    return KVStore(service.connect(world.rank), mode, len(service.workers), service)


def _factory(optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None) -> Any:
    if optimizer is None:
        return lambda key, group, tensors: None
    return lambda key, group, tensors: optimizer(tensors)


__all__ = [
    "KVSTORE_TYPES",
    "Connection",
    "KVStore",
    "ServerAbort",
    "ServerExit",
    "ServerLost",
    "connect",
]
