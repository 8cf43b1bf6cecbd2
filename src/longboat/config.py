"""Typed, validated configuration.

One frozen model per component, loaded from a dict, a TOML/JSON/YAML file or the DeepSpeed JSON
dialect (see :mod:`longboat.config_deepspeed`). Every error is a :class:`ConfigError` that names the
key, the value and how to fix it. This module imports nothing else of longboat.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

StrategyName = Literal["auto", "single", "replicate", "zero"]


class ConfigError(ValueError):
    """A configuration mistake; the message names the key, the value and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Section):
    """The batch triple: give any two of the three (or only the micro-batch)."""

    train_batch_size: int | None = Field(None, gt=0, description="global samples per step")
    micro_batch_size: int | None = Field(None, gt=0, description="samples per rank per forward")
    gradient_accumulation_steps: int | None = Field(None, gt=0, description="micro-batches/step")


class OptimizerConfig(_Section):
    """An optimizer for the engine to build when the user passes none (``torch.optim`` name)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(_Section):
    """An LR scheduler for the engine to build (``torch.optim.lr_scheduler`` name)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class ReplicateConfig(_Section):
    """Bucketed all-reduce data parallelism."""

    bucket_mb: float = Field(25.0, gt=0, description="gradient bucket size in MiB")
    first_bucket_mb: float = Field(
        1.0, gt=0, description="size of the first bucket, small so communication starts early"
    )
    overlap_optimizer: bool = Field(
        True, description="step the optimizer bucket by bucket as each all-reduce completes "
        "(only without clipping, and only for per-parameter optimizers)"
    )


class ZeroConfig(_Section):
    """Sharded data parallelism (ZeRO): stage 1 shards optimizer state, 2 also gradients,
    3 also parameters."""

    stage: Literal[1, 2, 3] = 1
    bucket_mb: float = Field(
        25.0, gt=0, description="stages 1-2: size of the flat buffers gradients are reduced in"
    )
    unit_classes: list[str] = Field(
        default_factory=list,
        description="stage 3: module class names whose instances gather their parameters as "
        "one unit (e.g. ['Block']); empty = choose by size",
    )
    unit_min_params: int = Field(
        1_000_000, gt=0,
        description="stage 3 with no unit_classes: smallest module (in parameters) made a unit",
    )
    prefetch: bool = Field(True, description="stage 3: gather the next unit while this one runs")


_FP16_ONLY = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "min_loss_scale")


class PrecisionConfig(_Section):
    """Compute precision: the forward runs under autocast in ``dtype`` with the model's fp32
    parameters as master weights; fp16 adds loss scaling (DeepSpeed's rules, see
    :mod:`longboat.precision`)."""

    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = Field(0.0, ge=0, description="fp16: 0 = dynamic, > 0 = this static scale")
    initial_scale_power: int = Field(
        16, ge=0, le=127, description="fp16 dynamic: the scale starts at 2**initial_scale_power")
    loss_scale_window: int = Field(
        1000, gt=0, description="fp16 dynamic: steps in a row without overflow before it doubles")
    hysteresis: int = Field(
        2, ge=1, description="fp16 dynamic: overflows tolerated before the scale halves "
        "(the hysteresis-th halves it; refilled when the scale doubles)")
    min_loss_scale: float = Field(
        1.0, gt=0, description="fp16 dynamic: never halve below this; an overflow there is an "
        "error")
    communication_data_type: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="dtype gradients travel in between ranks (replicate); None = their "
        "own dtype (fp32)")

    @model_validator(mode="after")
    def _fp16_keys_need_fp16(self) -> PrecisionConfig:
        stray = [k for k in _FP16_ONLY if k in self.model_fields_set]
        if stray and self.dtype != "fp16":
            keys = ", ".join(f"precision.{k}" for k in stray)
            raise ValueError(f"{keys}: only for dtype 'fp16' (dtype is {self.dtype!r}); remove "
                             "or set precision.dtype = 'fp16'")
        return self


class DataConfig(_Section):
    """How :meth:`Engine.loader` shards and orders data."""

    shuffle: bool = True
    remainder: Literal["drop", "pad"] = Field(
        "drop",
        description="samples that do not fill every rank: drop them, or pad by repeating samples",
    )
    num_workers: int = Field(0, ge=0)


class CheckpointConfig(_Section):
    """Checkpoints written by ``engine.save_checkpoint`` (see :mod:`longboat.checkpoint`)."""

    keep_last: int = Field(
        0, ge=0, description="keep only the newest K complete checkpoints of a directory "
        "(older ones are deleted after each save); 0 = keep all")


class LogConfig(_Section):
    """Console output."""

    progress: bool = True
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class SinkConfig(_Section):
    """A file monitor: it writes under ``output_path/job_name/`` on rank 0."""

    enabled: bool = False
    output_path: str = Field("runs", description="directory the job's folder is created in")
    job_name: str = Field("longboat", description="folder under output_path for this run")


class MonitorConfig(_Section):
    """Step events (loss, lr, loss scale, samples/s, tokens/s, step time) reduced across ranks
    and sent to the console, a CSV file and TensorBoard (see ``docs/monitoring.md``)."""

    every: int = Field(1, gt=0, description="optimizer steps between events")
    console: bool = Field(True, description="rank-0 progress bar (lines when piped); "
                          "log.progress = false also turns it off")
    total_steps: int | None = Field(None, gt=0, description="steps of the run, for the ETA; "
                                    "also engine.set_total_steps(n)")
    csv: SinkConfig = Field(default_factory=SinkConfig)
    tensorboard: SinkConfig = Field(default_factory=SinkConfig)


class ProfileConfig(_Section):
    """The step profiler: where a step's wall-clock time goes, and its flops."""

    wall_clock_breakdown: bool = Field(
        False, description="time data loading, forward, backward, communication wait, "
        "optimizer and checkpointing per step; a table at close()")
    flops: bool = Field(False, description="count one step's flops (after a warm-up step) and "
                        "report achieved flop/s beside a measured matmul rate")


class CommConfig(_Section):
    """The collectives doorway: timeout, desync check and comm log (see docs/diagnostics.md)."""

    timeout_s: float = Field(
        600.0, gt=0, description="seconds a collective may wait for its peers before every "
        "surviving rank reports who did not arrive and exits")
    desync_check: bool = Field(
        True, description="share a fingerprint of each collective first, so ranks out of step "
        "fail at once naming the ranks and the difference")
    log: bool = Field(False, description="count bytes and time per operation; a table at close")
    log_verbose: bool = Field(False, description="with log: also one line per collective")


class Config(_Section):
    """The whole configuration of a run."""

    strategy: StrategyName = Field(
        "auto", description="auto = single for one process, replicate otherwise"
    )
    seed: int = 0
    gradient_clipping: float = Field(0.0, ge=0, description="max global grad norm; 0 = off")
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    replicate: ReplicateConfig = Field(default_factory=ReplicateConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    comm: CommConfig = Field(default_factory=CommConfig)

    def resolved_strategy(self, world_size: int) -> str:
        """The strategy actually used at this world size."""
        if self.strategy == "auto":
            return "single" if world_size == 1 else "replicate"
        return self.strategy


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
    for key, val in (("train_batch_size", t), ("micro_batch_size", m),
                     ("gradient_accumulation_steps", a)):
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


def _closest(name: str, choices: list[str]) -> str | None:
    hits = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return hits[0] if hits else None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config model that owns the key at ``loc`` (the path without its last element)."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        sub = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)]
        model = next((a for a in sub if issubclass(a, BaseModel)), None)
    return model


def _explain(err: ValidationError, origin: str) -> ConfigError:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.endswith("Config")))
        key = ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            owner = _model_at(loc)
            valid = sorted(owner.model_fields) if owner else []
            guess = _closest(str(loc[-1]), valid)
            hint = f"did you mean '{'.'.join([*map(str, loc[:-1]), guess])}'?" if guess else (
                f"valid keys here: {', '.join(valid)}")
            lines.append(f"unknown key '{key}' (value {e['input']!r}); {hint}")
        else:
            val = e.get("input")
            lines.append(f"key '{key}' has invalid value {val!r}: {e['msg']}")
    return ConfigError(f"invalid config{origin}:\n  " + "\n  ".join(lines))


def read_mapping(path: str | Path) -> dict[str, Any]:
    """Read a TOML, JSON or YAML file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist")
    text = p.read_text()
    suffix = p.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(
                f"config file '{p}': unknown extension '{suffix}'; use .toml, .json, .yaml or .yml"
            )
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file '{p}' cannot be parsed: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{p}' must hold a mapping at the top, got {type(data)}")
    return data


@dataclass(frozen=True)
class LoadedConfig:
    """A config together with where each user-set key came from (for ``config explain``)."""

    config: Config
    sources: dict[str, str]


def _user_keys(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in data.items():
        if isinstance(v, Mapping) and k not in ("params",):
            keys.extend(_user_keys(v, f"{prefix}{k}."))
        else:
            keys.append(f"{prefix}{k}")
    return keys


def load(source: Config | Mapping[str, Any] | str | Path | None = None) -> LoadedConfig:
    """Load a config from a :class:`Config`, a dict, a file path, or ``None`` (all defaults).

    A mapping in the DeepSpeed JSON dialect is recognised by its keys and translated.
    """
    if isinstance(source, Config):
        return LoadedConfig(source, {k: "given as Config" for k in source.model_fields_set})
    origin = ""
    if source is None:
        data: Mapping[str, Any] = {}
    elif isinstance(source, (str, Path)):
        data = read_mapping(source)
        origin = f" in '{source}'"
    elif isinstance(source, Mapping):
        data = source
    else:
        raise ConfigError(
            f"config must be a dict, a path or a longboat.Config, got {type(source).__name__}"
        )
    where = origin.strip().removeprefix("in ") or "dict"
    from longboat import config_deepspeed  # local import: the dialect module imports this one

    if config_deepspeed.looks_like_deepspeed(data):
        data, sources = config_deepspeed.translate(data, where)
    else:
        sources = {k: f"set in {where}" for k in _user_keys(data)}
    try:
        cfg = Config.model_validate(dict(data))
    except ValidationError as err:
        raise _explain(err, origin) from None
    return LoadedConfig(cfg, sources)


def load_config(source: Config | Mapping[str, Any] | str | Path | None = None) -> Config:
    """Load and validate a config; see :func:`load`."""
    return load(source).config


def flatten(cfg: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Every resolved value of a config as ``{"dotted.key": value}``."""
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        val = getattr(cfg, name)
        if isinstance(val, BaseModel):
            out.update(flatten(val, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = val
    return out


def _source_of(key: str, sources: dict[str, str]) -> str:
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in sources:
            return sources[".".join(parts[:n])]
    return "default"


def explain(source: Config | Mapping[str, Any] | str | Path | None, world_size: int) -> str:
    """Every resolved value at ``world_size`` processes and where it came from, as text."""
    loaded = load(source)
    cfg = loaded.config
    rows = []
    values = flatten(cfg)
    strategy = cfg.resolved_strategy(world_size)
    batch = resolve_batch(cfg.batch, world_size)
    derived = {
        "strategy": (strategy, f"auto -> {strategy} at world size {world_size}")
        if cfg.strategy == "auto" else None,
    }
    for key, value in values.items():
        if key.startswith("batch."):
            name = key.removeprefix("batch.")
            value = getattr(batch, name)
            how = batch.explanation.get(name, "default")
            src = loaded.sources.get(key, how) if how == "set" else how
            rows.append((key, value, src))
            continue
        src = _source_of(key, loaded.sources)
        if key == "strategy" and derived["strategy"]:
            value, note = derived["strategy"]
            src = f"{src}; {note}"
        rows.append((key, value, src))
    width = max(len(k) for k, _, _ in rows)
    vwidth = min(max(len(repr(v)) for _, v, _ in rows), 40)
    lines = [f"longboat config at world size {world_size}:"]
    lines += [f"  {k.ljust(width)}  {v!r:<{vwidth}}  {s}" for k, v, s in rows]
    return "\n".join(lines)
