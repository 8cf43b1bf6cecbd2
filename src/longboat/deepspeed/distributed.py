"""DeepSpeed's ``deepspeed.init_distributed``: the default process group joined as
:func:`longboat.initialize` joins it, with DeepSpeed's arguments ([Note: DeepSpeed call sites] in
``deepspeed/__init__.py``)."""

from __future__ import annotations

import atexit
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from longboat.config.errors import ConfigError
from longboat.world import World, before_group, default_backend, destroy_process_group
from longboat.world import init_process_group as _join_group

log = logging.getLogger("longboat")


# The backends DeepSpeed's accelerators name, by the device each needs: a script written for one
# of them (``hccl`` for Ascend NPUs, ``ccl``/``xccl`` for Intel GPUs) names it even on a machine
# that has none. longboat computes on CUDA GPUs and CPUs, so there the backend follows the device
# as longboat's own initialize chooses it, and the substitution is logged, not silent.
_OTHER_ACCELERATORS = {"hccl": "an Ascend NPU", "ccl": "an Intel GPU", "xccl": "an Intel GPU"}


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """DeepSpeed's ``deepspeed.init_distributed``: join the default process group as
    :func:`longboat.initialize` would, from the launcher's environment (``longboat run``,
    torchrun, DeepSpeed's launcher, Slurm, Open MPI; ``auto_mpi_discovery`` needs no mpi4py
    here), once: a later call, and ``initialize`` afterwards, use the group that exists. A world
    of one (plain ``python script.py``) needs no group.

    ``dist_backend``: ``nccl``, ``gloo`` or ``mpi`` as torch has them; None is NCCL beside a
    GPU and gloo otherwise. An accelerator's backend that this machine cannot run (``hccl``,
    ``ccl``, ``xccl``, or ``nccl`` without a GPU) becomes that default, with a log line.
    ``distributed_port`` is the port when the environment names none; ``timeout`` bounds each
    collective; ``init_method`` (``tcp://``, ``file://``) with ``rank`` and ``world_size``
    joins without a launcher; ``dist_init_required=False`` only checks that a group exists.
    ``config`` is accepted as DeepSpeed's is here, for its comms logging: the config given to
    :func:`initialize` sets longboat's (``comms_logger``)."""
    del verbose, config  # logging is longboat's; see the docstring for config
    if dist_init_required is False:
        if not dist.is_initialized():
            raise ConfigError(
                "deepspeed.init_distributed(dist_init_required=False): no process group exists; "
                "create one first, or leave dist_init_required at None"
            )
        return
    if dist.is_initialized():  # idempotent, as DeepSpeed's: the group that exists is kept
        return
    if not isinstance(timeout, datetime.timedelta):
        raise ConfigError(f"init_distributed(timeout={timeout!r}) must be a datetime.timedelta")
    env = dict(os.environ)
    env.setdefault("MASTER_PORT", str(distributed_port))
    world = World.from_env(env)
    backend = _backend(dist_backend, world)
    if init_method not in (None, "env://"):
        _join_by_url(init_method, backend, rank, world_size, timeout)
        return
    for name, given, have in (
        ("rank", rank, world.rank),
        ("world_size", world_size, world.world_size),
    ):
        if given not in (-1, have):
            raise ConfigError(
                f"deepspeed.init_distributed({name}={given}): the launcher's environment says "
                f"{name} {have} ({world.source}); leave it at -1, or give init_method='tcp://...' "
                "to join without a launcher"
            )
    if _join_group(world, backend, timeout.total_seconds()):
        # The group outlives the engine (its close() leaves a group it did not create), so it
        # is left at exit, as a Horovod script's is: see [Note: dynamo before the group].
        atexit.register(destroy_process_group)


def _backend(name: str | None, world: World) -> str | None:
    """The backend to create for ``dist_backend=name`` (None: longboat's default)."""
    if name is None:
        return None
    name = name.lower()
    gpu = torch.cuda.is_available()
    if name == "gloo" or (name == "nccl" and gpu and dist.is_nccl_available()):
        return name
    if name == "mpi":
        if not dist.is_mpi_available():
            raise ConfigError(
                "deepspeed.init_distributed(dist_backend='mpi'): this torch is built without "
                "MPI; leave dist_backend at None (NCCL beside a GPU, gloo otherwise)"
            )
        return name
    if name in _OTHER_ACCELERATORS or name == "nccl":
        chosen = default_backend()
        if world.is_main and world.distributed:
            needs = _OTHER_ACCELERATORS.get(name, "a CUDA GPU")
            log.warning(
                "deepspeed.init_distributed(dist_backend=%r): that backend needs %s, which "
                "this machine does not give longboat; using %s for its %s",
                name,
                needs,
                chosen,
                "GPUs" if gpu else "CPU",
            )
        return chosen
    raise ConfigError(
        f"deepspeed.init_distributed(dist_backend={name!r}): {name!r} is not a backend "
        "longboat can use; give 'nccl', 'gloo' or 'mpi', or None for the device's default"
    )


def _join_by_url(
    url: str, backend: str | None, rank: int, world_size: int, timeout: datetime.timedelta
) -> None:
    """Join with torch's ``init_method`` URL, as DeepSpeed passes it on: the URL and the two
    numbers say everything, no launcher's environment is read."""
    if rank < 0 or world_size < 1:
        raise ConfigError(
            f"deepspeed.init_distributed(init_method={url!r}) needs rank=... and world_size=..."
        )
    before_group()
    dist.init_process_group(
        backend or default_backend(),
        init_method=url,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    atexit.register(destroy_process_group)
