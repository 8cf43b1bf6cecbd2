"""The DeepSpeed JSON dialect, translated into longboat's own config keys.

Keys with a meaning here keep DeepSpeed's; keys that have no effect here are accepted with one
log line saying why, features longboat lacks are accepted while switched off, and everything
else is named in a :class:`~longboat.config.ConfigError` (with the real key a misspelt one is
closest to) rather than silently ignored, so a DeepSpeed config never trains with settings its
author did not get ([Note: DeepSpeed keys] in ``deepspeed_keys.py``). Hugging Face's ``"auto"``
values resolve from the Trainer's arguments ([Note: auto values] in ``deepspeed_auto.py``). The
nested blocks (``zero_optimization``, ``pipeline``, ``activation_checkpointing``, ``compile``) are
translated in ``deepspeed_blocks.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from longboat.config import deepspeed_keys as keys
from longboat.config.deepspeed_auto import resolve_auto
from longboat.config.deepspeed_blocks import (
    checked_block,
    translate_activation_checkpointing,
    translate_compile,
    translate_pipeline,
    translate_zero,
)
from longboat.config.errors import ConfigError
from longboat.config.sections import OWN_OPTIMIZERS

log = logging.getLogger("longboat")

# What DeepSpeed clips the global gradient norm at when its config has no gradient_clipping
# ([Note: DeepSpeed clips by default]).
DEFAULT_GRADIENT_CLIPPING = 1.0

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

# [Note: DeepSpeed's bf16] DeepSpeed 0.19.8's ``"bf16": {"enabled": true}`` does more than
# autocast: the engine casts the module's parameters to bf16, keeping buffers in fp32
# (``_configure_distributed_model`` in ``runtime/engine.py``), and the optimizer wrapper keeps
# fp32 masters of them: ZeRO-1/2 an fp32 copy of each rank's partition
# (``single_partition_of_fp32_groups`` in ``runtime/zero/stage_1_and_2.py``), all-gathering the
# bf16 flat groups after each step; ZeRO-3 its ``fp32_partitioned_groups_flat``
# (``runtime/zero/stage3.py``); ZeRO-1 with ``data_types.grad_accum_dtype = 'fp32'`` the
# ``BF16_Optimizer`` (``runtime/bf16_optimizer.py``, fp32 gradient accumulation too). Gradients
# travel in bf16 unless ``communication_data_type`` says otherwise. That is
# ``precision.param_dtype = 'bf16'`` ([Note: parameter dtype] in
# ``strategies/zero/gather.py``), so the key translates to it as well as to ``precision.dtype``.
# Where the composition table refuses param_dtype (no ZeRO, offload, pipeline or tensor
# parallelism, compression: ``config/compositions/features.py``), ``loading.load`` keeps the
# translation a DeepSpeed config had before: bf16 autocast over fp32 parameters, with one log
# line naming the key and the refusal; a DeepSpeed config that loaded before still loads.
BF16_PARAMS = (
    "DeepSpeed key 'bf16.enabled' (bf16 parameters and fp32 master weights, as DeepSpeed "
    "keeps them)"
)


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
    if "gradient_clipping" not in data:
        # [Note: DeepSpeed clips by default] DeepSpeed 0.19.8 clips the global gradient norm at
        # 1.0 when its config says nothing (GRADIENT_CLIPPING_DEFAULT in its constants), so a
        # DeepSpeed config without the key clips here too; "gradient_clipping": 0 turns it off,
        # as there. Caught by tests/test_deepspeed_side_by_side.py.
        out["gradient_clipping"] = DEFAULT_GRADIENT_CLIPPING
        src["gradient_clipping"] = f"DeepSpeed's default (no 'gradient_clipping' in {where})"

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
    if bf16:  # [Note: DeepSpeed's bf16]
        put("precision.param_dtype", "bf16", "bf16.enabled")
        src["precision.param_dtype"] = f"{BF16_PARAMS} in {where}"
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
            block = checked_block(data[ds_key], ds_key, {"enabled", "output_path", "job_name"})
            for k, v in block.items():
                if k == "output_path" and v == "":
                    continue  # DeepSpeed's default: keep longboat's ("runs")
                put(f"{key}.{k}", v, f"{ds_key}.{k}")
    if "wandb" in data:
        block = checked_block(data["wandb"], "wandb", {"enabled", "team", "group", "project"})
        for k, v in block.items():
            put(f"monitor.wandb.{'entity' if k == 'team' else k}", v, f"wandb.{k}")
    if "steps_per_print" in data:  # DeepSpeed's progress line every N steps
        put("monitor.every", data["steps_per_print"], "steps_per_print")
    if "data_types" in data:
        b = checked_block(data["data_types"], "data_types", {"grad_accum_dtype"})
        if b.get("grad_accum_dtype") not in (None, "fp32"):
            raise ConfigError(
                f"DeepSpeed key 'data_types.grad_accum_dtype' = {b['grad_accum_dtype']!r} is not "
                "supported: gradients accumulate in fp32 here; set it to 'fp32' or remove it"
            )
    if "wall_clock_breakdown" in data:
        put("profile.wall_clock_breakdown", data["wall_clock_breakdown"], "wall_clock_breakdown")
    if "flops_profiler" in data:
        # Only the switch: DeepSpeed's per-module tables and profile_step are not offered.
        block = checked_block(data["flops_profiler"], "flops_profiler", {"enabled"})
        if "enabled" in block:
            put("profile.flops", block["enabled"], "flops_profiler.enabled")
    if "comms_logger" in data:
        # debug/prof_all/prof_ops choose what DeepSpeed prints; longboat logs every operation.
        block = checked_block(data["comms_logger"], "comms_logger", {"enabled", "verbose"})
        for k, key in (("enabled", "comm.log"), ("verbose", "comm.log_verbose")):
            if k in block:
                put(key, block[k], f"comms_logger.{k}")

    if "pipeline" in data:
        translate_pipeline(data["pipeline"], put)
    if "activation_checkpointing" in data:
        translate_activation_checkpointing(data["activation_checkpointing"], put)
    if "compile" in data:
        translate_compile(data["compile"], put)

    if "zero_optimization" in data:
        translate_zero(data["zero_optimization"], where, put)
    return out, src
