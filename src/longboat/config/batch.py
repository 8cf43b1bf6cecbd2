"""The batch triple: global batch = micro-batch x accumulation x data-parallel ranks; any two
give the third, with an explanation of each value."""

from __future__ import annotations

from dataclasses import dataclass

from longboat.config.errors import ConfigError
from longboat.config.sections import BatchConfig


@dataclass(frozen=True)
class ResolvedBatch:
    """The batch triple after filling in the missing member, with how it was derived."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    explanation: dict[str, str]


def resolve_batch(batch: BatchConfig, data_parallel_size: int) -> ResolvedBatch:
    """Resolve ``train = micro x accumulation x data_parallel_size``; any two give the third.

    With only ``micro_batch_size`` the accumulation defaults to 1; with only
    ``train_batch_size`` it also defaults to 1 and micro is derived.
    """
    if data_parallel_size < 1:
        raise ConfigError(f"data-parallel size must be >= 1, got {data_parallel_size}")
    t, m, a = batch.train_batch_size, batch.micro_batch_size, batch.gradient_accumulation_steps
    n = data_parallel_size
    how: dict[str, str] = {}
    for key, val in (
        ("train_batch_size", t),
        ("micro_batch_size", m),
        ("gradient_accumulation_steps", a),
    ):
        if val is not None:
            how[key] = "set"
    if t is None and m is None:
        raise ConfigError(
            "batch: neither 'batch.train_batch_size' nor 'batch.micro_batch_size' is set; "
            "set at least one, e.g. batch.micro_batch_size = 32"
        )
    if t is not None and m is not None and a is not None:
        if t != m * a * n:
            raise ConfigError(
                f"batch: train_batch_size={t} != micro_batch_size={m} x "
                f"gradient_accumulation_steps={a} x data-parallel size {n} (= {m * a * n}); "
                "drop one of the three keys to have it derived, or make them agree"
            )
    elif t is None:
        a = a or 1
        how.setdefault("gradient_accumulation_steps", "default 1")
        t = m * a * n  # type: ignore[operator]
        how["train_batch_size"] = f"derived: micro {m} x accumulation {a} x data-parallel {n}"
    elif m is None:
        a = a or 1
        how.setdefault("gradient_accumulation_steps", "default 1")
        if t % (a * n):
            raise ConfigError(
                f"batch: train_batch_size={t} is not divisible by gradient_accumulation_steps={a}"
                f" x data-parallel size {n} (= {a * n}); choose a train_batch_size that is a "
                f"multiple of {a * n}, or set micro_batch_size instead"
            )
        m = t // (a * n)
        how["micro_batch_size"] = f"derived: train {t} / (accumulation {a} x data-parallel {n})"
    else:
        if t % (m * n):
            raise ConfigError(
                f"batch: train_batch_size={t} is not divisible by micro_batch_size={m} x "
                f"data-parallel size {n} (= {m * n}); choose a train_batch_size that is a "
                f"multiple of {m * n}, or set gradient_accumulation_steps instead"
            )
        a = t // (m * n)
        how["gradient_accumulation_steps"] = f"derived: train {t} / (micro {m} x data-parallel {n})"
    return ResolvedBatch(t, m, a, n, how)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Loading
