"""Loading a configuration from a :class:`Config`, a dict, or a TOML/JSON/YAML file (a JSON with
DeepSpeed's keys is translated by :mod:`longboat.config.deepspeed`), with errors that name the
key, the value and the closest valid key; and ``explain``: every resolved value and its
source."""

from __future__ import annotations

import difflib
import json
import logging
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from longboat.config import deepspeed
from longboat.config.batch import resolve_batch
from longboat.config.compositions import refusal
from longboat.config.errors import ConfigError
from longboat.config.sections import Config

log = logging.getLogger("longboat")


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
            hint = (
                f"did you mean '{'.'.join([*map(str, loc[:-1]), guess])}'?"
                if guess
                else (f"valid keys here: {', '.join(valid)}")
            )
            lines.append(f"unknown key '{key}' (value {e['input']!r}); {hint}")
        elif not loc:  # a rule across sections: its message names the keys
            lines.append(str(e["msg"]).removeprefix("Value error, "))
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
    # A DeepSpeed config's ZeRO stage as DeepSpeed reads it (0 when it has no zero_optimization
    # block); None for longboat's own configs. Explain shows it: DeepSpeed's stage 0 leaves the
    # zero.* keys unused, whatever their defaults say.
    deepspeed_zero_stage: int | None = None


def _user_keys(data: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in data.items():
        if isinstance(v, Mapping) and k not in ("params",):
            keys.extend(_user_keys(v, f"{prefix}{k}."))
        else:
            keys.append(f"{prefix}{k}")
    return keys


def load(
    source: Config | Mapping[str, Any] | str | Path | None = None,
    trainer_args: Mapping[str, Any] | None = None,
) -> LoadedConfig:
    """Load a config from a :class:`Config`, a dict, a file path, or ``None`` (all defaults).

    A mapping in the DeepSpeed JSON dialect is recognised by its keys and translated; its
    ``"auto"`` values resolve from ``trainer_args`` (Hugging Face ``TrainingArguments`` names).
    """
    if isinstance(source, Config):
        _refuse_compositions(source, "")
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
    ds_stage = None
    if deepspeed.looks_like_deepspeed(data):
        ds_stage = _deepspeed_stage(data.get("zero_optimization"))
        data, sources = deepspeed.translate(data, where, trainer_args)
    else:
        sources = {k: f"set in {where}" for k in _user_keys(data)}
    cfg = _validated(data, origin)
    cfg, sources = _bf16_params_or_autocast(cfg, data, sources, where)
    _refuse_compositions(cfg, origin)
    return LoadedConfig(cfg, sources, ds_stage)


def _validated(data: Mapping[str, Any], origin: str) -> Config:
    try:
        return Config.model_validate(dict(data))
    except ValidationError as err:
        raise _explain(err, origin) from None


def _bf16_params_or_autocast(
    cfg: Config, data: Mapping[str, Any], sources: dict[str, str], where: str
) -> tuple[Config, dict[str, str]]:
    """[Note: DeepSpeed's bf16] in ``deepspeed.py``: a translated ``bf16.enabled`` keeps its
    ``precision.param_dtype`` where the compositions take it, else falls back to bf16 autocast
    over fp32 parameters (what it meant before), saying so once."""
    if not sources.get("precision.param_dtype", "").startswith(deepspeed.BF16_PARAMS):
        return cfg, sources
    why = refusal(cfg)
    if why is None:
        return cfg, sources
    precision = {k: v for k, v in data["precision"].items() if k != "param_dtype"}
    plain = _validated({**data, "precision": precision}, f" in {where}")
    if refusal(plain) is not None:  # refused either way: the error is the one it had before
        return plain, sources
    log.warning(
        "DeepSpeed key 'bf16.enabled' in %s: bf16 autocast over fp32 parameters, not "
        "DeepSpeed's bf16 parameters with fp32 masters (precision.param_dtype = 'bf16'), "
        "which this config cannot take: %s",
        where,
        why,
    )
    sources = {
        **sources,
        "precision.dtype": f"{sources['precision.dtype']}; autocast over fp32 parameters",
        "precision.param_dtype": f"DeepSpeed key 'bf16.enabled' in {where}, not taken: {why}",
    }
    return plain, sources


def _deepspeed_stage(z: Any) -> int | None:
    """The stage DeepSpeed's get_zero_config reads: none given is 0, ``true`` is 1."""
    if z is None:
        return 0
    if isinstance(z, bool):
        return int(z)
    stage = z.get("stage", 0) if isinstance(z, Mapping) else None
    return stage if isinstance(stage, int) else None


def _refuse_compositions(cfg: Config, origin: str) -> None:
    """What the config alone decides does not combine ([Note: compositions])."""
    why = refusal(cfg)
    if why is not None:
        raise ConfigError(f"invalid config{origin}:\n  {why}")


def load_config(
    source: Config | Mapping[str, Any] | str | Path | None = None,
    trainer_args: Mapping[str, Any] | None = None,
) -> Config:
    """Load and validate a config; see :func:`load`."""
    return load(source, trainer_args).config


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


def _no_zero(key: str, value: Any, stage_given: bool) -> tuple[Any, str]:
    """A zero.* row of a DeepSpeed config at stage 0: what DeepSpeed does, not an unused default."""
    if key != "zero.stage":
        return value, "unused: DeepSpeed's stage 0 has no ZeRO"
    why = "zero_optimization.stage = 0" if stage_given else "no 'zero_optimization' block"
    return 0, f"DeepSpeed's stage 0, no ZeRO ({why}): see strategy"


def explain(
    source: Config | Mapping[str, Any] | str | Path | None,
    world_size: int,
    trainer_args: Mapping[str, Any] | None = None,
) -> str:
    """Every resolved value at ``world_size`` processes and where it came from, as text."""
    loaded = load(source, trainer_args)
    cfg = loaded.config
    rows = []
    values = flatten(cfg)
    strategy = cfg.resolved_strategy(world_size)
    batch = resolve_batch(cfg.batch, cfg.data_parallel_size(world_size))
    derived = {
        "strategy": (strategy, f"auto -> {strategy} at world size {world_size}")
        if cfg.strategy == "auto"
        else None,
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
        if key.startswith("zero.") and loaded.deepspeed_zero_stage == 0:
            given = "zero_optimization.stage" in loaded.sources.get("strategy", "")
            value, src = _no_zero(key, value, given)
        if key == "strategy" and derived["strategy"]:
            value, note = derived["strategy"]
            src = f"{src}; {note}"
        rows.append((key, value, src))
    width = max(len(k) for k, _, _ in rows)
    vwidth = min(max(len(repr(v)) for _, v, _ in rows), 40)
    lines = [f"longboat config at world size {world_size}:"]
    lines += [f"  {k.ljust(width)}  {v!r:<{vwidth}}  {s}" for k, v, s in rows]
    return "\n".join(lines)
