"""The DeepSpeed JSON dialect, translated into longboat's own config keys.

Only keys longboat implements are accepted; every other DeepSpeed key is named in a
:class:`~longboat.config.ConfigError` rather than silently ignored, so a DeepSpeed config never
trains with settings its author did not get.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from longboat.config.errors import ConfigError

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
        "wall_clock_breakdown",
        "flops_profiler",
        "comms_logger",
        "pipeline",
        "activation_checkpointing",
    }
)

# DeepSpeed's optimizer names -> torch.optim class names. DeepSpeed's "Adam" is AdamW unless
# adam_w_mode is false (its FusedAdam defaults to decoupled weight decay).
_OPTIMIZERS = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}


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
_PRECISION_KEYS = {"fp16": {"enabled", "auto_cast", *_FP16_KEYS}, "bf16": {"enabled"}}
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


def translate(data: Mapping[str, Any], where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Translate a DeepSpeed config into longboat's keys, with the source of each key."""
    unknown = sorted(set(data) - _SUPPORTED)
    if unknown:
        raise ConfigError(
            f"DeepSpeed config in {where}: key(s) {', '.join(repr(k) for k in unknown)} are not "
            "supported yet; remove them or use longboat's own config keys "
            "(see `longboat config explain`)"
        )
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
        put(ds_key, {"type": typ, "params": params}, ds_key)

    fp16 = _enabled(data.get("fp16", {}), "fp16")
    bf16 = _enabled(data.get("bf16", {}), "bf16")
    if fp16 and bf16:
        raise ConfigError(
            "DeepSpeed keys 'fp16.enabled' and 'bf16.enabled' are both true; enable at most one"
        )
    if fp16 or bf16:
        put("precision.dtype", "fp16" if fp16 else "bf16", "fp16" if fp16 else "bf16")
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
        _activation_checkpointing(data["activation_checkpointing"])

    if "zero_optimization" in data:
        z = data["zero_optimization"]
        if not isinstance(z, Mapping):
            raise ConfigError(f"DeepSpeed key 'zero_optimization' must be an object, got {z!r}")
        extra = sorted(
            set(z) - {"stage", "reduce_bucket_size", "offload_optimizer", "offload_param"}
        )
        if extra:
            raise ConfigError(
                "DeepSpeed key(s) "
                + ", ".join(f"'zero_optimization.{k}'" for k in extra)
                + " are not supported yet; remove them"
            )
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
        if "offload_optimizer" in z:
            _offload(z["offload_optimizer"], "offload_optimizer", stage, put)
        if "offload_param" in z:
            _offload(z["offload_param"], "offload_param", stage, put)
    return out, src


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
# computed; partitioning over tensor-parallel ranks and CPU copies are not offered.
_AC_KEYS = {
    "partition_activations",
    "contiguous_memory_optimization",
    "cpu_checkpointing",
    "number_checkpoints",
    "synchronize_checkpoint_boundary",
    "profile",
}


def _activation_checkpointing(block: Any) -> None:
    b = _block(block, "activation_checkpointing", _AC_KEYS)
    for key, why in (
        ("partition_activations", "it splits checkpoints over tensor-parallel ranks"),
        ("cpu_checkpointing", "it copies checkpoints to CPU memory"),
    ):
        if b.get(key, False):
            raise ConfigError(
                f"DeepSpeed key 'activation_checkpointing.{key}' = true is not supported ({why}); "
                "set it to false or remove it, and choose recomputed modules with "
                "[activation_checkpointing] classes = [...]"
            )
