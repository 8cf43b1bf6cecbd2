"""The compositions in-job recovery (``recovery.in_job``, ``docs/recovery.md``) refuses
([Note: compositions] in ``config/compositions/__init__.py``): it carries on from state every
survivor holds whole, so strategies whose state has no replica, and features whose state is
each rank's own, are refused with the reason."""

from __future__ import annotations

from longboat.config.compositions.rule import (
    COMPRESSED,
    Facts,
    Rule,
    compressing,
    named,
    offloads,
    reducer,
    strategy_of,
)
from longboat.config.sections import Config

IN_JOB = {"recovery": {"in_job": True}}


_OFFLOADED = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def _in_job(c: Config) -> bool:
    return c.recovery.in_job


def _hybrid(c: Config) -> bool:
    """Hybrid sharding: replicas of the state across ``mesh.dp_replicate``."""
    return (c.mesh.dp_replicate or 1) > 1


RECOVERY: tuple[Rule, ...] = (
    Rule(
        "recovery-sharded",
        "recovery.in_job",
        "strategy 'zero' without mesh.dp_replicate",
        "by nature",
        "config",
        lambda c, f: _in_job(c) and strategy_of(c, f) == "zero" and not _hybrid(c),
        lambda c, f: (
            "recovery.in_job = true with strategy = 'zero' and no mesh.dp_replicate: each rank "
            "holds the only copy of its shard of the optimizer state (and, from stage 2, of the "
            "gradients and parameters), so a lost rank takes state no survivor has; shard "
            "within replicas (mesh.dp_replicate = 2 or more: hybrid sharding, each replica "
            "holding all of it), use strategy = 'replicate', or recover by restarting from a "
            "checkpoint (longboat run --max-restarts, docs/recovery.md)"
        ),
        {**IN_JOB, "strategy": "zero"},
    ),
    Rule(
        "recovery-offload",
        "recovery.in_job",
        "zero offload",
        "not built yet",
        "config",
        lambda c, f: _in_job(c) and strategy_of(c, f) == "zero" and offloads(c),
        lambda c, f: (
            "recovery.in_job = true with zero offload (offload_optimizer.device = "
            f"{c.zero.offload_optimizer.device!r}, offload_param.device = "
            f"{c.zero.offload_param.device!r}): the survivors regroup with their state in "
            "memory only so far; remove the offload keys or recovery.in_job"
        ),
        {**IN_JOB, "strategy": "zero", "mesh": {"dp_replicate": 2}, "zero": _OFFLOADED},
    ),
    Rule(
        "recovery-parameter-server",
        "recovery.in_job",
        "strategy 'parameter_server'",
        "by nature",
        "config",
        lambda c, f: _in_job(c) and c.strategy == "parameter_server",
        lambda c, f: (
            "recovery.in_job = true with strategy = 'parameter_server': the servers hold the "
            "only copy of their shards; asynchronous and ssp workers are already dropped when "
            "they die (docs/parameter_server.md); remove recovery.in_job"
        ),
        {**IN_JOB, "strategy": "parameter_server"},
    ),
    Rule(
        "recovery-mesh",
        "recovery.in_job",
        "mesh.pp or mesh.tp > 1 (or mesh.dp_replicate without zero)",
        "not built yet",
        "config",
        lambda c, f: (
            _in_job(c)
            and (c.mesh.pp > 1 or c.mesh.tp > 1 or (_hybrid(c) and strategy_of(c, f) != "zero"))
        ),
        lambda c, f: (
            f"recovery.in_job = true with mesh.pp = {c.mesh.pp}, mesh.tp = {c.mesh.tp}, "
            f"mesh.dp_replicate = {c.mesh.dp_replicate or 1}: so far the survivors regroup on "
            "data parallelism only (a lost pipeline stage or tensor slice has no copy on the "
            "survivors), and mesh.dp_replicate only with strategy = 'zero' (hybrid sharding); "
            "remove the axes or recovery.in_job"
        ),
        {**IN_JOB, "mesh": {"tp": 2}},
    ),
    Rule(
        "recovery-compression",
        "recovery.in_job",
        "compression",
        "not built yet",
        "config",
        lambda c, f: _in_job(c) and compressing(c, f),
        lambda c, f: (
            f"recovery.in_job = true with compression.method = {c.compression.method!r}: the "
            "compressor's error feedback is each rank's own and is not carried over a "
            "regroup yet; remove the [compression] section or recovery.in_job"
        ),
        {**IN_JOB, **COMPRESSED},
    ),
    Rule(
        "recovery-self-reducing",
        "recovery.in_job",
        "1-bit Adam or 1-bit LAMB",
        "not built yet",
        "build",
        lambda c, f: _in_job(c) and reducer(c, f) is not None,
        lambda c, f: (
            f"recovery.in_job = true with {named(c, f)}: its compression error is each rank's "
            "own and is not carried over a regroup yet; use another optimizer or remove "
            "recovery.in_job"
        ),
        {**IN_JOB, "optimizer": {"type": "OneBitAdam"}},
    ),
    Rule(
        "recovery-join",
        "recovery.in_job",
        "data.remainder 'join'",
        "not built yet",
        "config",
        lambda c, f: _in_job(c) and c.data.remainder == "join",
        lambda c, f: (
            "recovery.in_job = true with data.remainder = 'join': the join vote's state is not "
            "carried over a regroup yet; use data.remainder = 'drop' or 'pad'"
        ),
        {**IN_JOB, "data": {"remainder": "join"}},
    ),
    Rule(
        "recovery-nccl",
        "recovery.in_job",
        "NCCL (training on an accelerator)",
        "not built yet",
        "build",
        lambda c, f: _in_job(c) and f.device not in (None, "cpu") and c.comm.backend != "gloo",
        lambda c, f: (
            f"recovery.in_job = true with parameters on {f.device} and comm.backend = "
            f"{c.comm.backend!r}: a failed NCCL collective ends its process by default (torch's "
            "watchdog), and aborting and rebuilding NCCL communicators is not built yet; it is "
            "built and tested on gloo: set comm.backend = 'gloo', or remove recovery.in_job"
        ),
        IN_JOB,
        Facts(strategy="replicate", device="cuda"),
    ),
)
