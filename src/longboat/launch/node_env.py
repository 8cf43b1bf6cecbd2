"""Which node of which job ``longboat run`` is, read from what a scheduler put in the environment.

``longboat run`` starts the workers of one node, so a scheduler must start it once per node. Two
schedulers tell each such process where it stands, and :func:`detect` reads them:

* **Slurm**, under ``srun --ntasks-per-node=1``: ``SLURM_STEP_ID`` and ``SLURM_PROCID`` mark a
  task of a job step (a batch script or an ``salloc`` shell has ``SLURM_JOB_ID`` but no
  ``SLURM_STEP_ID``: not a launch, nothing detected). The step's nodes
  (``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``) are the nodes of the job, ``SLURM_NODEID``
  is this node, node 0 is the first host of ``SLURM_STEP_NODELIST`` (Slurm numbers a step's
  nodes in the order of its node list) unless ``MASTER_ADDR`` is set, and the port is
  ``MASTER_PORT`` or one derived from ``SLURM_JOB_ID``, which every node computes alike and
  which keeps two jobs sharing a node apart. A step with several tasks per node is the other
  way to use Slurm (each task *is* a worker; :mod:`longboat.world` reads that, for scripts run
  straight under ``srun``): ``longboat run`` there would start its workers once per task, so it
  is refused (:class:`TasksPerNodeError`) with the two ways out.
* **Kubernetes**, a Kubeflow ``PyTorchJob`` (or a Kubeflow Trainer ``TrainJob``), recognised by
  ``KUBERNETES_SERVICE_HOST`` (set in every pod) together with the operator's variables. What
  the operator sets, read in the kubeflow/training-operator source (``pkg/controller.v1/
  pytorch/envvar.go``, ``master.go``, ``elastic.go``; ``pkg/runtime/framework/plugins/torch``
  for the TrainJob):

  - since v1.7.0 (#1840), on every pod of a job with a Master replica: ``PET_NNODES`` (the
    number of pods; under an ``elasticPolicy`` with min/max replicas a range ``MIN:MAX``),
    ``PET_NODE_RANK`` (the pod's rank: Master 0, Worker ``i`` is ``i + 1``),
    ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (the Master pod's headless service and port), and
    the same values as ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; but ``WORLD_SIZE`` is the
    number of pods *times* ``nprocPerNode`` when that is a number (the worker count, not the
    node count), so it is never read where ``PET_NNODES`` is present;
  - before v1.7.0: only ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` (the pod's rank) and
    ``WORLD_SIZE`` (then the number of pods), plus ``PET_NNODES`` under an ``elasticPolicy``;
  - a TrainJob (Kubeflow Trainer v2): the ``PET_*`` variables only;
  - a job without a Master replica, under an ``elasticPolicy``: no rank and no master at all,
    only ``PET_RDZV_ENDPOINT``, because torch's ``c10d`` rendezvous hands out the node ranks;
    ``longboat run``'s rendezvous is static (ranks are given), so that is refused, naming the
    flags to pass instead.

  ``PET_*`` are preferred wherever present (they are the ones meant for a per-node launcher;
  torchrun reads them as its flags), then the older names.

Anything else (no scheduler, or the environment of a worker some launcher started, which has
``TORCHELASTIC_RUN_ID``) gives ``None``: the caller keeps its single-node defaults. A job of
one node keeps them too (127.0.0.1 and a free port: nothing to agree on with other nodes, and
no fixed port to collide with). Values that are not integers, or a node rank out of range,
raise :class:`NodeEnvError` naming the variable and its value.

Pure functions of a mapping, no torch: ``longboat run`` reads this before its usage errors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass


class NodeEnvError(ValueError):
    """The environment cannot be read as one node of a job; the message names the variable."""


class TasksPerNodeError(NodeEnvError):
    """``srun`` started several tasks per node, each of which would start its own workers."""


@dataclass(frozen=True)
class NodeDefaults:
    """This node's place in its job, as a scheduler described it."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None  # None: a free port (a job of one node)
    source: str  # where the values came from, e.g. "Slurm (SLURM_NNODES, SLURM_NODEID, ...)"


def detect(env: Mapping[str, str]) -> NodeDefaults | None:
    """The node flags for ``longboat run`` from ``env``, or None when no scheduler launched it.

    Raises :class:`TasksPerNodeError` under an ``srun`` with several tasks per node and
    :class:`NodeEnvError` for values that cannot be used (see the module docstring).
    """
    if "TORCHELASTIC_RUN_ID" in env:  # a worker of torchrun / longboat run, not a node
        return None
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _from_slurm(env)
    if "KUBERNETES_SERVICE_HOST" in env:
        return _from_kubeflow(env)
    return None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list, e.g. ``gpu[003-005,9],cpu1`` -> ``gpu003``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


def slurm_master_addr(env: Mapping[str, str]) -> str:
    """``MASTER_ADDR``, else the first host of the step's (else the job's) node list, else
    127.0.0.1."""
    addr, _ = _slurm_master_addr(env)
    return addr or "127.0.0.1"


def slurm_master_port(env: Mapping[str, str]) -> int:
    """``MASTER_PORT``, else a port derived from ``SLURM_JOB_ID`` (15000-34999).

    Every task of a job derives the same one, and two jobs sharing a node get different ones
    unless their ids are 20000 apart.
    """
    if env.get("MASTER_PORT"):
        return _port(env, "MASTER_PORT")
    return 15000 + _int(env, "SLURM_JOB_ID", "0") % 20000


def _slurm_master_addr(env: Mapping[str, str]) -> tuple[str | None, str]:
    """(address of node 0 or None, the variable it came from)."""
    key = _first_set(env, "MASTER_ADDR", *_NODELISTS)
    if key is None:
        return None, ""
    return (env[key] if key == "MASTER_ADDR" else first_host(env[key])), key


def _from_slurm(env: Mapping[str, str]) -> NodeDefaults | None:
    nodes_key = _first_set(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    tasks_key = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if nodes_key is None or tasks_key is None:
        return None  # not an srun step as Slurm sets one up
    nnodes = _int(env, nodes_key)
    ntasks = _int(env, tasks_key)
    if nnodes < 1:
        raise NodeEnvError(
            f"environment variable {nodes_key}={env[nodes_key]!r}: a job step has at least 1 node"
        )
    if ntasks != nnodes:
        raise TasksPerNodeError(
            f"srun started {ntasks} tasks on {nnodes} node(s) ({tasks_key}={ntasks}, "
            f"{nodes_key}={nnodes}): longboat run starts the workers itself, one task per node "
            "is enough; use `srun --ntasks-per-node=1 longboat run -n K ...`, or run the "
            "script directly under srun without longboat run"
        )
    rank_key = "SLURM_NODEID" if "SLURM_NODEID" in env else "SLURM_PROCID"
    node_rank = _rank(env, rank_key, nnodes, nodes_key)
    if nnodes == 1:
        return _one_node(f"Slurm ({nodes_key}, {rank_key})")
    addr, addr_key = _slurm_master_addr(env)
    if addr is None:
        raise NodeEnvError(
            f"srun started {nnodes} nodes but set none of {', '.join(_NODELISTS)}: set "
            "MASTER_ADDR to node 0's address, or pass --master-addr"
        )
    port_key = "MASTER_PORT" if env.get("MASTER_PORT") else "SLURM_JOB_ID"
    return NodeDefaults(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=addr,
        master_port=slurm_master_port(env),
        source=f"Slurm ({nodes_key}, {rank_key}, {addr_key}, {port_key})",
    )


def _from_kubeflow(env: Mapping[str, str]) -> NodeDefaults | None:
    nodes_key = _first_set(env, "PET_NNODES", "WORLD_SIZE")
    # WORLD_SIZE counts workers, not pods, wherever PET_NNODES exists (module docstring).
    rank_key = _first_set(env, "PET_NODE_RANK", "RANK")
    if nodes_key is None and rank_key is None:
        return None  # a pod, but not one a PyTorchJob set up
    addr_key = _first_set(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    port_key = _first_set(env, "PET_MASTER_PORT", "MASTER_PORT")
    if nodes_key is None or rank_key is None or addr_key is None or port_key is None:
        wanted = {
            "PET_NNODES or WORLD_SIZE": nodes_key,
            "PET_NODE_RANK or RANK": rank_key,
            "PET_MASTER_ADDR or MASTER_ADDR": addr_key,
            "PET_MASTER_PORT or MASTER_PORT": port_key,
        }
        missing = ", ".join(name for name, key in wanted.items() if key is None)
        raise NodeEnvError(
            f"this Kubernetes pod looks like part of a PyTorchJob but has no {missing} (a job "
            "without a Master replica leaves node ranks to torch's c10d rendezvous, which "
            "longboat run does not use): add a Master replica, or pass --nnodes, --node-rank, "
            "--master-addr and --master-port"
        )
    nnodes = _nnodes(env, nodes_key)
    node_rank = _rank(env, rank_key, nnodes, nodes_key)
    if nnodes == 1:
        return _one_node(f"Kubernetes ({nodes_key}, {rank_key})")
    return NodeDefaults(
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=env[addr_key],
        master_port=_port(env, port_key),
        source=f"Kubernetes ({nodes_key}, {rank_key}, {addr_key}, {port_key})",
    )


def _one_node(source: str) -> NodeDefaults:
    return NodeDefaults(
        nnodes=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=None,
        source=source,
    )


def _first_set(env: Mapping[str, str], *keys: str) -> str | None:
    return next((key for key in keys if env.get(key)), None)


def _int(env: Mapping[str, str], key: str, default: str | None = None) -> int:
    value = env.get(key, default)
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise NodeEnvError(
            f"environment variable {key}={value!r} is not an integer; fix the launcher that set it"
        ) from None


def _nnodes(env: Mapping[str, str], key: str) -> int:
    """A node count; ``PET_NNODES`` may be torchrun's ``MIN:MAX``, usable only when fixed."""
    low, sep, high = env[key].partition(":")
    if sep:
        try:
            fixed = int(low) == int(high)
        except ValueError:
            fixed = False
        if not fixed:
            raise NodeEnvError(
                f"environment variable {key}={env[key]!r} is a range of node counts (an elastic"
                " PyTorchJob): longboat run needs a fixed one; set minReplicas = maxReplicas, "
                "or pass --nnodes"
            )
        n = int(low)
    else:
        n = _int(env, key)
    if n < 1:
        raise NodeEnvError(f"environment variable {key}={env[key]!r}: a job has at least 1 node")
    return n


def _rank(env: Mapping[str, str], key: str, nnodes: int, nodes_key: str) -> int:
    rank = _int(env, key)
    if not 0 <= rank < nnodes:
        raise NodeEnvError(
            f"environment variable {key}={env[key]!r} is out of range for {nodes_key}="
            f"{env[nodes_key]!r}: node ranks go from 0 to {nnodes - 1}"
        )
    return rank


def _port(env: Mapping[str, str], key: str) -> int:
    port = _int(env, key)
    if not 1 <= port <= 65535:
        raise NodeEnvError(f"environment variable {key}={env[key]!r} is not a TCP port (1-65535)")
    return port
