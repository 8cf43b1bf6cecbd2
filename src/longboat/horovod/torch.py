"""Horovod's PyTorch API on ``torch.distributed``: a Horovod script runs with one import changed,
``import longboat.horovod.torch as hvd``, under ``longboat run`` (or torchrun, Slurm, mpirun).

[Note: Horovod API] Each function keeps Horovod's meaning and rides on the default process
group (gloo on CPU, NCCL on GPU), joined by :func:`init` from the launcher's environment as
``longboat.initialize`` joins it; the job's shape is read from that group and the environment
each time. The collectives (collectives.py) begin with a small exchange in which the ranks
compare what they are about to do ([Note: Horovod negotiation] in negotiate.py), so ranks that
disagree get Horovod's error on every rank instead of a gloo abort, a hang or a wrong result,
and ranks with fewer batches can stop early with ``hvd.join()`` ([Note: Horovod join] in
joining.py). ``DistributedOptimizer`` (optimizer.py) reduces the gradients in ``step()``
([Note: Horovod optimizer order]). ``hvd.elastic`` resumes from the last commit on longboat's
restarts ([Note: elastic on restarts] in elastic.py); process sets ([Note: Horovod process
sets] in process_sets.py); asynchronous allreduces matched by name whatever order the ranks
issue them in ([Note: Horovod pending operations] in pending.py). Not here: the C++ timeline.
"""

from __future__ import annotations

import atexit
import itertools

import torch
import torch.distributed as dist

from longboat.horovod import (
    elastic,  # noqa: F401 (hvd.elastic, as in Horovod)
    joining,
)
from longboat.horovod.collectives import (
    Adasum,
    Average,
    Handle,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    rank,
    reducescatter,
    size,
    sparse_allreduce,
    sparse_allreduce_async,
    synchronize,
)
from longboat.horovod.compression import Compression
from longboat.horovod.negotiate import HorovodInternalError
from longboat.horovod.optimizer import DistributedOptimizer
from longboat.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
    where,
)
from longboat.horovod.state import broadcast_optimizer_state, broadcast_parameters
from longboat.world import World, destroy_process_group, init_process_group

# -- the job -------------------------------------------------------------------------------------

# How many groups init() has created in this process: every rank runs the same init/shutdown
# cycles, so the count agrees between ranks and names each later group's keys in the
# launcher's store apart from the earlier ones' (see ``store_prefix`` in world.py).
_GROUPS = itertools.count()


def init(*_: object, **__: object) -> None:
    """Join the job (a world of one without a launcher); again after :func:`shutdown`. As
    Horovod does, leaving is registered for the interpreter's exit, so a script that never
    calls :func:`shutdown` still frees the group, and ends gloo's threads, before the
    interpreter shuts down ([Note: dynamo before the group] in world.py says why that matters).
    The exit leaves without :func:`shutdown`'s barrier: a rank that exits on an error must not
    wait there for ranks still training."""
    world = World.from_env()
    if world.distributed and not dist.is_initialized():
        n = next(_GROUPS)
        if init_process_group(world, store_prefix=f"longboat.horovod.{n}/" if n else ""):
            atexit.unregister(destroy_process_group)  # once, however often init() runs
            atexit.register(destroy_process_group)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # The control group (a gloo one beside NCCL) while every rank is here: made at a
        # rank's first collective instead, an asynchronous one that only queues would wait
        # there for its peers' first collective ([Note: Horovod process sets]).
        global_process_set.global_control()


def shutdown() -> None:
    """Leave the job cleanly (a gloo group torn down at interpreter exit can abort it)."""
    # Every rank at the end before any closes its connections: a rank that tore its gloo
    # pairs down while a peer still finished was seen to abort the peer (SIGABRT) at exit.
    # hvd's own barrier, so a peer still waiting for an asynchronous operation (or a round a
    # poll left under way) meets it in a round and both raise, instead of hanging
    # ([Note: Horovod pending operations] in pending.py).
    if dist.is_initialized() and dist.get_world_size() > 1:
        barrier()
    global_process_set.forget()
    destroy_process_group()


def is_initialized() -> bool:
    return dist.is_initialized() or not World.from_env().distributed


def local_rank() -> int:
    return World.from_env().local_rank


def local_size() -> int:
    return World.from_env().local_world_size


def cross_rank() -> int:
    """This node's index among the nodes."""
    return rank() // local_size()


def cross_size() -> int:
    """The number of nodes."""
    return size() // local_size()


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the other ranks' allreduces (direct ones,
    grouped ones and ``DistributedOptimizer``'s) with zeros until every rank has called
    ``join``, then return the rank that joined last, the same on every rank ([Note: Horovod
    join] in joining.py).

    While a rank has joined, ``op=Average`` still divides by ``hvd.size()``, all ranks, as
    Horovod does: the result is the sum over the ranks still active, divided by the number of
    all ranks. Other collectives (allgather, broadcast, alltoall, reducescatter, barrier,
    Adasum) raise on the active ranks while a rank has joined; the joined rank goes on
    serving. ``device``: the CUDA device index for
    the zeros, or -1 (the default) for CPU, as in Horovod.
    """
    if size() == 1:
        return rank()
    zeros_on = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    return joining.join(zeros_on, where(None, "join"))


# -- what this build has (Horovod's build queries) -----------------------------------------------


def gloo_built() -> bool:
    """Whether torch has gloo, which carries the control plane here."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """gloo carries every exchange of [Note: Horovod negotiation], whatever the data backend."""
    return gloo_built()


def mpi_built() -> bool:
    """longboat never uses MPI (``mpirun`` may still start the processes)."""
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """Horovod raises when MPI is not in use; so does this build, which never uses it."""
    raise ValueError(
        "mpi_threads_supported: longboat.horovod does not use MPI (mpi_built() is False)"
    )


def nccl_built() -> bool:
    return dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return torch.version.hip is not None


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "ProcessSet",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce",
    "sparse_allreduce_async",
    "synchronize",
]
