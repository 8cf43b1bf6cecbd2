"""DeepSpeed's nested blocks translated into longboat's keys: ``zero_optimization`` (with its
offload blocks), ``pipeline``, ``activation_checkpointing`` and ``compile``. Each takes the
``put(key, value, ds_key)`` of :func:`longboat.config.deepspeed.translate`, which records where
every key came from."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from longboat.config import deepspeed_keys as keys
from longboat.config.errors import ConfigError
from longboat.config.sections_parallel import swap_path_problem

log = logging.getLogger("longboat")


def checked_block(block: Any, key: str, allowed: set[str]) -> Mapping[str, Any]:
    """A DeepSpeed sub-object, refusing keys longboat does not implement by name."""
    if not isinstance(block, Mapping):
        raise ConfigError(f"DeepSpeed key '{key}' must be an object, got {block!r}")
    extra = sorted(set(block) - allowed)
    if extra:
        raise ConfigError(
            f"DeepSpeed key(s) {', '.join(f'{key}.{k}' for k in extra)} are not supported; "
            f"remove them (supported here: {', '.join(sorted(allowed))})"
        )
    return block


def translate_zero(z: Any, where: str, put: Any) -> None:
    """DeepSpeed's ``zero_optimization`` block: the strategy, the stage and its offload."""
    if isinstance(z, bool):  # DeepSpeed's oldest form: true is stage 1
        z = {"stage": 1 if z else 0}
    if not isinstance(z, Mapping):
        raise ConfigError(f"DeepSpeed key 'zero_optimization' must be an object, got {z!r}")
    _screen_zero(z, where)
    stage = z.get("stage", 0)
    if stage == 0:
        put("strategy", "replicate", "zero_optimization.stage")
    elif stage in (1, 2, 3):
        put("strategy", "zero", "zero_optimization.stage")
        put("zero.stage", stage, "zero_optimization.stage")
        if "reduce_bucket_size" in z:  # DeepSpeed counts elements; longboat MiB of fp32
            put(
                "zero.bucket_mb",
                z["reduce_bucket_size"] * 4 / 2**20,
                "zero_optimization.reduce_bucket_size",
            )
    else:
        raise ConfigError(
            f"DeepSpeed key 'zero_optimization.stage' = {stage!r} is invalid; use 0, 1, 2 or 3"
        )
    for name in ("stage3_prefetch_bucket_size", "prefetch_bucket_size"):
        if z.get(name) == 0 and stage == 3:  # DeepSpeed prefetches nothing then
            put("zero.prefetch", False, f"zero_optimization.{name}")
    for old, new in (
        ("cpu_offload", "offload_optimizer"),
        ("cpu_offload_param", "offload_param"),
        ("cpu_offload_params", "offload_param"),
    ):
        if z.get(old) and new not in z:  # DeepSpeed's deprecated switches, as it maps them
            log.info(
                "DeepSpeed key 'zero_optimization.%s' is DeepSpeed's old name for %s with "
                "device 'cpu': read as that",
                old,
                new,
            )
            z = {**z, new: {"device": "cpu"}}
    for name in ("offload_optimizer", "offload_param"):
        if z.get(name) is not None:  # null is DeepSpeed's default: no offload
            _offload(z[name], name, stage, put)


# zero_optimization keys that are off at these values (DeepSpeed's defaults), beyond false/null
_ZERO_OFF: dict[str, tuple[Any, ...]] = {
    "zero_hpz_partition_size": (1,),
    "mics_shard_size": (-1, 0),
}


def _screen_zero(z: Mapping[str, Any], where: str) -> None:
    """[Note: DeepSpeed keys] for ``zero_optimization``."""
    known = keys.ZERO_TRANSLATED | set(keys.ZERO_NO_EFFECT) | set(keys.ZERO_REFUSED)
    unknown = sorted(set(z) - known)
    if unknown:
        raise ConfigError(
            f"DeepSpeed config in {where}: key(s) "
            + ", ".join(f"'zero_optimization.{k}'{keys.near_miss(k, known)}" for k in unknown)
            + " are not DeepSpeed keys longboat knows; remove them"
        )
    for k in sorted(set(z) & set(keys.ZERO_REFUSED)):
        v = z[k]
        if k == "compute_grad_norm":  # on by default; only false switches the norm off
            if v is True or v is None:
                continue
        elif v in (False, None) or keys.disabled(v) or v in _ZERO_OFF.get(k, ()):
            continue  # zenflow is a block: {} or {"enabled": false} is off too
        raise ConfigError(
            f"DeepSpeed key 'zero_optimization.{k}' = {v!r} in {where} is not supported: "
            f"{keys.ZERO_REFUSED[k]}; remove it"
        )
    for k in sorted(set(z) & set(keys.ZERO_NO_EFFECT)):
        if not keys.ZERO_NO_EFFECT[k]:
            continue  # translated where it is read
        log.info(
            "DeepSpeed key 'zero_optimization.%s' has no effect here: %s",
            k,
            keys.ZERO_NO_EFFECT[k],
        )


# DeepSpeed's offload_optimizer and offload_param blocks: device none/cpu/nvme; nvme_path;
# buffer_count (its swap buffers: here the units in memory at once); pin_memory matters with an
# accelerator only. offload_param's buffer_size and max_in_cpu size DeepSpeed's own parameter
# buffers, which have no counterpart here (each unit's shard is its own buffer): refused.
# offload_optimizer's pipeline_read/pipeline_write/fast_init/super_offload/cpuadam_cores_perc
# tune DeepSpeed's own swapper and CPU Adam: no effect, logged. Its ratio below 1 (part of the
# state offloaded) is not offered: accepted at 1.0, its default.
_OFFLOAD_DEVICES = {"none": "none", "cpu": "cpu", "nvme": "disk"}
_OFFLOAD_NO_EFFECT = {
    "pipeline_read": "it overlaps DeepSpeed's NVMe reads",
    "pipeline_write": "it overlaps DeepSpeed's NVMe writes",
    "fast_init": "it speeds up DeepSpeed's NVMe swapper start",
    "super_offload": "it selects DeepSpeed's superchip CPU optimizer",
    "cpuadam_cores_perc": "it sizes DeepSpeed's CPU Adam thread pool",
}


def _offload(block: Any, name: str, stage: Any, put: Any) -> None:
    key = f"zero_optimization.{name}"
    allowed = {"device", "nvme_path", "buffer_count", "pin_memory"}
    if name == "offload_optimizer":
        allowed |= {*_OFFLOAD_NO_EFFECT, "ratio"}
    b = checked_block(block, key, allowed)
    if b.get("ratio", 1.0) != 1.0:
        raise ConfigError(
            f"DeepSpeed key '{key}.ratio' = {b['ratio']!r} is not supported: offloading part "
            "of the optimizer state is not offered; remove it (all of it is offloaded)"
        )
    for k in sorted(set(b) & set(_OFFLOAD_NO_EFFECT)):
        log.info("DeepSpeed key '%s.%s' has no effect here: %s", key, k, _OFFLOAD_NO_EFFECT[k])
    device = b.get("device", "none")
    if device not in _OFFLOAD_DEVICES:
        raise ConfigError(
            f"DeepSpeed key '{key}.device' = {device!r} is invalid; use none, cpu or nvme"
        )
    if _OFFLOAD_DEVICES[device] != "none" and stage not in (1, 2, 3):
        raise ConfigError(
            f"DeepSpeed key '{key}.device' = {device!r} needs zero_optimization.stage 1, 2 or 3 "
            f"(got {stage!r}): offload moves sharded state"
        )
    put(f"zero.{name}.device", _OFFLOAD_DEVICES[device], f"{key}.device")
    path = b.get("nvme_path")
    problem = swap_path_problem(path) if device == "nvme" and isinstance(path, str) else None
    if problem:  # named by the key the user wrote ([Note: offload path])
        raise ConfigError(f"DeepSpeed key '{key}.nvme_path' = {path!r}: {problem}")
    if "nvme_path" in b:
        put(f"zero.{name}.path", b["nvme_path"], f"{key}.nvme_path")
    if "buffer_count" in b:
        put(f"zero.{name}.buffer_count", b["buffer_count"], f"{key}.buffer_count")


# DeepSpeed's ``pipeline`` block (runtime/config.py's defaults). ``pipe_partitioned`` and
# ``grad_partitioned`` split the activations and gradients sent between stages over the
# tensor-parallel group; with no tensor parallelism (longboat's mesh.tp is 1) there is nothing to
# split and DeepSpeed sends them whole too, so either value trains the same.
_PIPELINE_KEYS = {
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
}


def translate_pipeline(block: Any, put: Any) -> None:
    b = checked_block(block, "pipeline", _PIPELINE_KEYS)
    stages = b.get("stages", "auto")
    if stages != "auto":
        if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
            raise ConfigError(
                f"DeepSpeed key 'pipeline.stages' = {stages!r} is invalid; use a number of "
                "stages (1 or more) or 'auto'"
            )
        put("mesh.pp", stages, "pipeline.stages")
    method = b.get("partition", "best")
    if method != "best":  # DeepSpeed's placeholder: its PipelineModule balances parameters
        put("pipeline.partition", method, "pipeline.partition")
    if b.get("seed_layers", False):
        raise ConfigError(
            "DeepSpeed key 'pipeline.seed_layers' = true is not supported (it re-seeds each "
            "layer's initialisation); build the model with the seed you want and remove it"
        )
    interval = b.get("activation_checkpoint_interval", 0)
    if interval:
        raise ConfigError(
            f"DeepSpeed key 'pipeline.activation_checkpoint_interval' = {interval!r} is not "
            "supported: choose the recomputed layers by class with longboat's "
            "[activation_checkpointing] classes = [...] and every = k, and remove it"
        )


# DeepSpeed's ``activation_checkpointing`` block tunes how deepspeed.checkpointing stores the
# checkpoints a model asks for in its own code; which modules are recomputed is longboat's
# ``[activation_checkpointing]``. Buffer layout, synchronisation and timing do not change what is
# computed; cpu_checkpointing keeps the checkpoints in CPU memory here too ([Note: cpu
# checkpointing] in recompute.py); partitioning over tensor-parallel ranks has nothing to split.
_AC_KEYS = {
    "partition_activations",
    "contiguous_memory_optimization",
    "cpu_checkpointing",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
}


def translate_activation_checkpointing(block: Any, put: Any) -> None:
    b = checked_block(block, "activation_checkpointing", _AC_KEYS)
    if b.get("partition_activations", False):
        # It splits each checkpoint over the model-parallel ranks, which a DeepSpeed config
        # does not have here (its mesh.tp is 1): a split into one part is the whole.
        log.info(
            "DeepSpeed key 'activation_checkpointing.partition_activations' has no effect here: "
            "there are no tensor-parallel ranks to split checkpoints over"
        )
    cpu = b.get("cpu_checkpointing", False)
    if not isinstance(cpu, bool):
        raise ConfigError(
            f"DeepSpeed key 'activation_checkpointing.cpu_checkpointing' = {cpu!r} must be true "
            "or false"
        )
    if cpu:
        put(
            "activation_checkpointing.cpu_checkpointing",
            True,
            "activation_checkpointing.cpu_checkpointing",
        )


# DeepSpeed's ``compile`` block (its CompileConfig): ``enabled``, ``backend`` and ``kwargs``
# passed to torch.compile, which here become the [compile] section's keys (longboat compiles
# block by block, as docs/compile.md says). ``deepcompile`` turns on DeepSpeed's own compiler
# passes over ZeRO's communication, which have no counterpart here.
_COMPILE_KWARGS = {"mode", "fullgraph", "dynamic", "options"}


def translate_compile(block: Any, put: Any) -> None:
    b = checked_block(block, "compile", {"enabled", "backend", "kwargs", "deepcompile"})
    if b.get("deepcompile", False):
        raise ConfigError(
            "DeepSpeed key 'compile.deepcompile' = true is not supported: DeepCompile's passes "
            "over ZeRO's communication are DeepSpeed's own; remove it ('compile.enabled' = true "
            "compiles the model block by block here)"
        )
    for k in ("enabled", "backend"):
        if k in b:
            put(f"compile.{k}", b[k], f"compile.{k}")
    for k, v in checked_block(b.get("kwargs", {}), "compile.kwargs", _COMPILE_KWARGS).items():
        put(f"compile.{k}", v, f"compile.kwargs.{k}")
