"""Hugging Face's ``"auto"`` values in a DeepSpeed config, resolved as its Trainer resolves them.

[Note: auto values] The Trainer's DeepSpeed integration lets a config say ``"auto"`` where the
value is one of its own arguments (``TrainingArguments``) or follows from the model: the
micro-batch from ``per_device_train_batch_size``, the learning rate from ``learning_rate``, the
ZeRO buckets from the model's ``hidden_size``, and so on. DeepSpeed itself does not accept them.
Here they resolve from the same arguments when they are given (``load_config(...,
trainer_args={...})``, ``longboat config explain FILE --trainer-arg NAME=VALUE``), by the same
rules; an ``"auto"`` whose argument is not given is refused with the key and the argument it
needs, and an ``"auto"`` the Trainer would not resolve either is refused with its key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from longboat.config.errors import ConfigError

# dotted DeepSpeed key -> (the Trainer's arguments it is made from, how)
_RULES: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
    "train_micro_batch_size_per_gpu": (("per_device_train_batch_size",), int),
    "gradient_accumulation_steps": (("gradient_accumulation_steps",), int),
    "gradient_clipping": (("max_grad_norm",), float),
    "optimizer.params.lr": (("learning_rate",), float),
    "optimizer.params.betas": (("adam_beta1", "adam_beta2"), lambda a, b: [float(a), float(b)]),
    "optimizer.params.eps": (("adam_epsilon",), float),
    "optimizer.params.weight_decay": (("weight_decay",), float),
    "scheduler.params.warmup_min_lr": ((), lambda: 0.0),
    "scheduler.params.warmup_max_lr": (("learning_rate",), float),
    "scheduler.params.warmup_num_steps": (("warmup_steps",), int),
    "scheduler.params.total_num_steps": (("max_steps",), int),
    "fp16.enabled": (("fp16",), bool),
    "bf16.enabled": (("bf16",), bool),
    "zero_optimization.reduce_bucket_size": (("hidden_size",), lambda h: int(h) * int(h)),
    "zero_optimization.stage3_prefetch_bucket_size": (
        ("hidden_size",),
        lambda h: int(0.9 * int(h) * int(h)),
    ),
    "zero_optimization.stage3_param_persistence_threshold": (
        ("hidden_size",),
        lambda h: 10 * int(h),
    ),
}
# Derived by the Trainer from others (world size x micro-batch x accumulation): longboat derives
# it the same way when it is left out.
_DERIVED = {"train_batch_size"}
# "auto" that is DeepSpeed's own value (translated by deepspeed.py), not the Trainer's.
_DEEPSPEEDS = {"pipeline.stages"}


def resolve_auto(
    data: Mapping[str, Any], where: str, trainer_args: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``data`` with every ``"auto"`` replaced (or, for a derived key, left out)."""
    args = dict(trainer_args or {})

    def walk(node: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, Mapping):
                out[k] = walk(v, f"{key}.")
            elif isinstance(v, str) and v == "auto" and key not in _DEEPSPEEDS:
                if key in _DERIVED:
                    continue
                out[k] = _resolve(key, args, where)
            else:
                out[k] = v
        return out

    return walk(data, "")


def _resolve(key: str, args: dict[str, Any], where: str) -> Any:
    rule = _RULES.get(key)
    if rule is None:
        raise ConfigError(
            f"DeepSpeed key '{key}' = 'auto' in {where}: Hugging Face's Trainer does not "
            "resolve this key either; give it a value"
        )
    names, make = rule
    missing = [n for n in names if n not in args]
    if missing:
        raise ConfigError(
            f"DeepSpeed key '{key}' = 'auto' in {where} is filled in by Hugging Face's Trainer "
            f"from its argument(s) {', '.join(missing)}; give the key a value, or pass "
            + ", ".join(f"{n}=..." for n in missing)
            + " as trainer arguments (load_config(..., trainer_args={...}) or "
            "`longboat config explain FILE --trainer-arg NAME=VALUE`)"
        )
    try:
        return make(*(args[n] for n in names))
    except (TypeError, ValueError):
        raise ConfigError(
            f"trainer argument(s) {', '.join(f'{n}={args[n]!r}' for n in names)} cannot fill "
            f"DeepSpeed key '{key}' = 'auto' in {where}"
        ) from None


__all__ = ["resolve_auto"]
