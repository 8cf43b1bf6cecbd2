"""The DeepSpeed JSON dialect, translated into longboat's own config keys.

Keys with a meaning here keep DeepSpeed's; keys that have no effect here are accepted with one
log line saying why, features longboat lacks are accepted while switched off, and everything
else is named in a :class:`~longboat.config.ConfigError` (with the real key a misspelt one is
closest to) rather than silently ignored, so a DeepSpeed config never trains with settings its
author did not get ([Note: DeepSpeed keys] in ``deepspeed_keys.py``). Hugging Face's ``"auto"``
values resolve from the Trainer's arguments ([Note: auto values] in ``deepspeed_auto.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from longboat.config import deepspeed_keys as keys
from longboat.config.deepspeed_auto import resolve_auto
from longboat.config.errors import ConfigError
from longboat.config.sections import OWN_OPTIMIZERS

log = logging.getLogger("longboat")

# Keys whose presence at the top level marks a mapping as DeepSpeed's (longboat nests these).
_MARKERS = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "fp16",
        "bf16",
        "zero_optimization",
    }
)

_SUPPORTED = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "optimizer",
        "scheduler",
        "fp16",
        "bf16",
        "zero_optimization",
        "seed",
        "communication_data_type",
        "tensorboard",
        "csv_monitor",
        "wandb",
        "wall_clock_breakdown",
        "flops_profiler",
        "comms_logger",
        "pipeline",
        "activation_checkpointing",
        "steps_per_print",
        "bfloat16",
        "data_types",
        "compile",
    }
)

# DeepSpeed's optimizer names -> torch.optim class names, or longboat's own (its FusedLamb is
# longboat.optim.Lamb, with the same parameters). DeepSpeed's "Adam" is AdamW unless
# adam_w_mode is false (its FusedAdam defaults to decoupled weight decay).
_OPTIMIZERS = {
    "adam": "AdamW",
    "adamw": "AdamW",
    "sgd": "SGD",
    "adagrad": "Adagrad",
    "lamb": "Lamb",
    # DeepSpeed's 1-bit Adam and 1-bit LAMB, with their parameter names (longboat.optim)
    "onebitadam": "OneBitAdam",
    "onebitlamb": "OneBitLamb",
}


def looks_like_deepspeed(data: Mapping[str, Any]) -> bool:
    """True when the mapping uses DeepSpeed's top-level keys."""
    return any(k in _MARKERS for k in data)


# fp16/bf16 keys translated into ``precision.*`` (same meaning and defaults as DeepSpeed's).
# ``auto_cast`` is accepted and has nothing to translate: DeepSpeed's fp16 converts the model to
# fp16 and auto_cast decides whether inputs are cast to match; longboat keeps fp32 weights and
# runs the forward under torch.autocast, which casts every operation's inputs either way.
_FP16_KEYS = (
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
)
_PRECISION_KEYS = {
    "fp16": {"enabled", "auto_cast", "fp16_master_weights_and_grads", *_FP16_KEYS},
    "bf16": {"enabled"},
}
_COMM_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16"}


def _enabled(block: Any, key: str) -> bool:
    if isinstance(block, bool):
        return block
    if not isinstance(block, Mapping):
        raise ConfigError(
            f"DeepSpeed key '{key}' must be an object like {{\"enabled\": true}}, got {block!r}"
        )
    on = block.get("enabled", False)
    if not isinstance(on, bool):
        raise ConfigError(
            f"DeepSpeed key '{key}.enabled' = {on!r} must be true or false "
            "('auto' is resolved by the Hugging Face Trainer, not by DeepSpeed)"
        )
    extra = sorted(set(block) - _PRECISION_KEYS[key])
    if extra and on:
        raise ConfigError(
            f"DeepSpeed key(s) {', '.join(f'{key}.{k}' for k in extra)} are not supported yet; "
            f"remove them (longboat would otherwise ignore them)"
        )
    return on


def _block(block: Any, key: str, allowed: set[str]) -> Mapping[str, Any]:
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


def _screen(data: Mapping[str, Any], where: str) -> None:
    """Refuse unknown keys (with the near-miss) and features switched on that longboat lacks;
    log the keys that have no effect here ([Note: DeepSpeed keys])."""
    known = _SUPPORTED | set(keys.NO_EFFECT) | set(keys.OFF_ONLY)
    unknown = sorted(set(data) - known)
    misspelt = [k for k in unknown if keys.near_miss(k, known)]
    if misspelt:
        raise ConfigError(
            f"DeepSpeed config in {where}: key(s) "
            + ", ".join(f"{k!r}{keys.near_miss(k, known)}" for k in misspelt)
            + " are not DeepSpeed keys; correct them or remove them"
        )
    if unknown:  # DeepSpeed ignores keys it does not know at the top level; say so, once
        log.warning(
            "DeepSpeed config in %s: key(s) %s are not DeepSpeed keys; ignored, as DeepSpeed "
            "ignores them",
            where,
            ", ".join(repr(k) for k in unknown),
        )
    if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(data):
        raise ConfigError(
            f"DeepSpeed config in {where} gives neither 'train_batch_size' nor "
            "'train_micro_batch_size_per_gpu'; DeepSpeed needs one, and so does longboat"
        )
    for k in sorted(set(data) & set(keys.OFF_ONLY)):
        if not keys.disabled(data[k]):
            raise ConfigError(
                f"DeepSpeed key '{k}' is switched on in {where}: {keys.OFF_ONLY[k]}; switch it "
                'off ("enabled": false) or remove it'
            )
    for k in sorted(set(data) & set(keys.NO_EFFECT)):
        if keys.NO_EFFECT[k]:
            log.info("DeepSpeed key '%s' has no effect here: %s", k, keys.NO_EFFECT[k])


def _check_type(ds_key: str, given: str, typ: str, where: str) -> None:
    """Refuse a DeepSpeed optimizer or scheduler that is not a torch class (nor one of the
    warm-up schedules longboat provides) before training, naming it."""
    import torch

    if ds_key == "optimizer":
        cls = getattr(torch.optim, typ, None)
        if typ in OWN_OPTIMIZERS or (
            isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        ):
            return
        what = "a torch.optim optimizer, Lamb, OneBitAdam or OneBitLamb"
    else:
        cls = getattr(torch.optim.lr_scheduler, typ, None)
        if typ in ("WarmupLR", "WarmupDecayLR") or isinstance(cls, type):
            return
        what = "WarmupLR, WarmupDecayLR or a torch.optim.lr_scheduler class"
    raise ConfigError(
        f"DeepSpeed key '{ds_key}.type' = {given!r} in {where} is not {what}; choose one, or "
        f"leave the '{ds_key}' block out and pass your own to longboat.initialize"
    )


def translate(
    data: Mapping[str, Any], where: str, trainer_args: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """Translate a DeepSpeed config into longboat's keys, with the source of each key.
    ``trainer_args``: Hugging Face Trainer arguments that ``"auto"`` values resolve from."""
    data = resolve_auto(data, where, trainer_args)
    if "bfloat16" in data:  # DeepSpeed's other name for the bf16 block
        if "bf16" in data:
            raise ConfigError(
                f"DeepSpeed keys 'bf16' and 'bfloat16' are both in {where}: they name the same "
                "block; keep one"
            )
        data = {("bf16" if k == "bfloat16" else k): v for k, v in data.items()}
    _screen(data, where)
    out: dict[str, Any] = {}
    src: dict[str, str] = {}

    def put(key: str, value: Any, ds_key: str) -> None:
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
        src[key] = f"DeepSpeed key '{ds_key}' in {where}"

    for ds_key, key in (
        ("train_batch_size", "batch.train_batch_size"),
        ("train_micro_batch_size_per_gpu", "batch.micro_batch_size"),
        ("gradient_accumulation_steps", "batch.gradient_accumulation_steps"),
        ("gradient_clipping", "gradient_clipping"),
        ("seed", "seed"),
    ):
        if ds_key in data and data[ds_key] != "auto":
            put(key, data[ds_key], ds_key)

    for ds_key in ("optimizer", "scheduler"):
        if ds_key not in data:
            continue
        block = data[ds_key]
        if not isinstance(block, Mapping) or "type" not in block:
            raise ConfigError(
                f"DeepSpeed key '{ds_key}' must be an object with a 'type', got {block!r}"
            )
        params = dict(block.get("params", {}))
        typ = str(block["type"])
        if ds_key == "optimizer":
            if typ.lower() == "adam" and not params.pop("adam_w_mode", True):
                typ = "Adam"
            else:
                typ = _OPTIMIZERS.get(typ.lower(), typ)
            params.pop("torch_adam", None)
        _check_type(ds_key, str(block["type"]), typ, where)
        put(ds_key, {"type": typ, "params": params}, ds_key)

    fp16 = _enabled(data.get("fp16", {}), "fp16")
    bf16 = _enabled(data.get("bf16", {}), "bf16")
    if fp16 and bf16:
        raise ConfigError(
            "DeepSpeed keys 'fp16.enabled' and 'bf16.enabled' are both true; enable at most one"
        )
    if fp16 or bf16:
        put("precision.dtype", "fp16" if fp16 else "bf16", "fp16" if fp16 else "bf16")
    if (
        fp16
        and isinstance(data["fp16"], Mapping)
        and data["fp16"].get("fp16_master_weights_and_grads")
    ):
        log.warning(
            "DeepSpeed key 'fp16.fp16_master_weights_and_grads' = true: longboat keeps fp32 "
            "master weights and gradients (more precise than asked, and their memory)"
        )
    if fp16 and isinstance(data["fp16"], Mapping):
        for k in _FP16_KEYS:
            if k in data["fp16"] and data["fp16"][k] != "auto":
                put(f"precision.{k}", data["fp16"][k], f"fp16.{k}")
    comm = data.get("communication_data_type")
    if comm is not None:
        if str(comm).lower() not in _COMM_DTYPES:
            raise ConfigError(
                f"DeepSpeed key 'communication_data_type' = {comm!r} is invalid; "
                "use 'fp32', 'fp16' or 'bf16'"
            )
        put(
            "precision.communication_data_type",
            _COMM_DTYPES[str(comm).lower()],
            "communication_data_type",
        )

    for ds_key, key in (("tensorboard", "monitor.tensorboard"), ("csv_monitor", "monitor.csv")):
        if ds_key in data:
            block = _block(data[ds_key], ds_key, {"enabled", "output_path", "job_name"})
            for k, v in block.items():
                if k == "output_path" and v == "":
                    continue  # DeepSpeed's default: keep longboat's ("runs")
                put(f"{key}.{k}", v, f"{ds_key}.{k}")
    if "wandb" in data:
        block = _block(data["wandb"], "wandb", {"enabled", "team", "group", "project"})
        for k, v in block.items():
            put(f"monitor.wandb.{'entity' if k == 'team' else k}", v, f"wandb.{k}")
    if "steps_per_print" in data:  # DeepSpeed's progress line every N steps
        put("monitor.every", data["steps_per_print"], "steps_per_print")
    if "data_types" in data:
        b = _block(data["data_types"], "data_types", {"grad_accum_dtype"})
        if b.get("grad_accum_dtype") not in (None, "fp32"):
            raise ConfigError(
                f"DeepSpeed key 'data_types.grad_accum_dtype' = {b['grad_accum_dtype']!r} is not "
                "supported: gradients accumulate in fp32 here; set it to 'fp32' or remove it"
            )
    if "wall_clock_breakdown" in data:
        put("profile.wall_clock_breakdown", data["wall_clock_breakdown"], "wall_clock_breakdown")
    if "flops_profiler" in data:
        # Only the switch: DeepSpeed's per-module tables and profile_step are not offered.
        block = _block(data["flops_profiler"], "flops_profiler", {"enabled"})
        if "enabled" in block:
            put("profile.flops", block["enabled"], "flops_profiler.enabled")
    if "comms_logger" in data:
        # debug/prof_all/prof_ops choose what DeepSpeed prints; longboat logs every operation.
        block = _block(data["comms_logger"], "comms_logger", {"enabled", "verbose"})
        for k, key in (("enabled", "comm.log"), ("verbose", "comm.log_verbose")):
            if k in block:
                put(key, block[k], f"comms_logger.{k}")

    if "pipeline" in data:
        _pipeline(data["pipeline"], put)
    if "activation_checkpointing" in data:
        _activation_checkpointing(data["activation_checkpointing"], put)
    if "compile" in data:
        _compile(data["compile"], put)

    if "zero_optimization" in data:
        z = data["zero_optimization"]
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
        prefetch = z.get("stage3_prefetch_bucket_size")
        if prefetch == 0 and stage == 3:  # DeepSpeed prefetches nothing then
            put("zero.prefetch", False, "zero_optimization.stage3_prefetch_bucket_size")
        for old, new in (
            ("cpu_offload", "offload_optimizer"),
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
        if "offload_optimizer" in z:
            _offload(z["offload_optimizer"], "offload_optimizer", stage, put)
        if "offload_param" in z:
            _offload(z["offload_param"], "offload_param", stage, put)
    return out, src


# zero_optimization keys that are off at these values (DeepSpeed's defaults)
_ZERO_OFF = {"zero_hpz_partition_size": (1,), "mics_shard_size": (-1, 0)}


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
        if v in (False, None) or v in _ZERO_OFF.get(k, ()):
            continue
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
_OFFLOAD_DEVICES = {"none": "none", "cpu": "cpu", "nvme": "disk"}


def _offload(block: Any, name: str, stage: Any, put: Any) -> None:
    key = f"zero_optimization.{name}"
    b = _block(block, key, {"device", "nvme_path", "buffer_count", "pin_memory"})
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


def _pipeline(block: Any, put: Any) -> None:
    b = _block(block, "pipeline", _PIPELINE_KEYS)
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


def _activation_checkpointing(block: Any, put: Any) -> None:
    b = _block(block, "activation_checkpointing", _AC_KEYS)
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


def _compile(block: Any, put: Any) -> None:
    b = _block(block, "compile", {"enabled", "backend", "kwargs", "deepcompile"})
    if b.get("deepcompile", False):
        raise ConfigError(
            "DeepSpeed key 'compile.deepcompile' = true is not supported: DeepCompile's passes "
            "over ZeRO's communication are DeepSpeed's own; remove it ('compile.enabled' = true "
            "compiles the model block by block here)"
        )
    for k in ("enabled", "backend"):
        if k in b:
            put(f"compile.{k}", b[k], f"compile.{k}")
    for k, v in _block(b.get("kwargs", {}), "compile.kwargs", _COMPILE_KWARGS).items():
        put(f"compile.{k}", v, f"compile.kwargs.{k}")
