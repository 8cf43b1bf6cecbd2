"""The chosen configuration as files: a longboat TOML config (with what was measured in its
header), and beside it the same configuration in DeepSpeed's JSON dialect where that dialect can
say all of it.

[Note: DeepSpeed round trip] The JSON is written only when longboat's own DeepSpeed reader
(``longboat.config.deepspeed``) loads it back to a config equal to the chosen one; otherwise the
keys it cannot carry are named instead. What it cannot carry: ``single`` (DeepSpeed's stage 0 is
data parallel), a ``replicate`` bucket size other than the default (DeepSpeed's
``reduce_bucket_size`` is read for ZeRO stages only), activation checkpointing of chosen module
classes (DeepSpeed's ``activation_checkpointing`` block tunes how checkpoints are stored, not
which modules are checkpointed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longboat.config.loading import flatten, load_config

_ELEMENT_BYTES = 4  # DeepSpeed sizes reduce buckets in elements; longboat's MiB are of fp32
_DEFAULT_BUCKET_MB = 25.0


class NotExpressible(ValueError):
    """The configuration has keys DeepSpeed's dialect cannot carry (the message names them)."""


def to_deepspeed(mapping: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed JSON of a longboat config mapping as ``longboat tune`` writes them, checked
    to load back to the same config ([Note: DeepSpeed round trip])."""
    batch = mapping["batch"]
    out: dict[str, Any] = {
        "train_batch_size": batch["train_batch_size"],
        "train_micro_batch_size_per_gpu": batch["micro_batch_size"],
        "gradient_accumulation_steps": batch["gradient_accumulation_steps"],
    }
    strategy = mapping["strategy"]
    if strategy == "single":
        raise NotExpressible(
            "strategy 'single': DeepSpeed's zero_optimization.stage 0 reads as 'replicate'"
        )
    if strategy == "replicate":
        bucket = mapping.get("replicate", {}).get("bucket_mb", _DEFAULT_BUCKET_MB)
        if bucket != _DEFAULT_BUCKET_MB:
            raise NotExpressible(
                f"replicate.bucket_mb = {bucket:g}: DeepSpeed's reduce_bucket_size is read for "
                "ZeRO stages only"
            )
        out["zero_optimization"] = {"stage": 0}
    else:
        zero = mapping["zero"]
        block: dict[str, Any] = {"stage": zero["stage"]}
        if "bucket_mb" in zero:
            elements = zero["bucket_mb"] * 2**20 / _ELEMENT_BYTES
            if not float(elements).is_integer():
                raise NotExpressible(
                    f"zero.bucket_mb = {zero['bucket_mb']:g} is not a whole number of fp32 "
                    "elements, which DeepSpeed's reduce_bucket_size counts"
                )
            block["reduce_bucket_size"] = int(elements)
        for key in ("offload_optimizer", "offload_param"):
            if key in zero:
                block[key] = {"device": "nvme", "nvme_path": zero[key]["path"]}
        out["zero_optimization"] = block
    if "activation_checkpointing" in mapping:
        classes = mapping["activation_checkpointing"]["classes"]
        raise NotExpressible(
            f"activation_checkpointing.classes = {classes}: DeepSpeed's activation_checkpointing "
            "block does not choose which modules are recomputed"
        )
    # Said whole: DeepSpeed's dialect clips at 1.0 where the key is absent, longboat at 0 (off).
    out["gradient_clipping"] = mapping.get("gradient_clipping", 0.0)
    precision = mapping.get("precision", {})
    if precision.get("dtype") == "bf16":
        out["bf16"] = {"enabled": True}
    comm = precision.get("communication_data_type")
    if comm is not None:
        out["communication_data_type"] = comm
    ours, theirs = flatten(load_config(mapping)), flatten(load_config(out))
    differ = sorted(k for k in ours if ours[k] != theirs[k])
    if differ:  # a key this function does not know of yet: refuse rather than write it wrong
        raise NotExpressible(f"{', '.join(differ)} would not survive the translation")
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"{v!r} has no TOML form here")
        return repr(v)  # always with a '.' or an exponent, so it reads back as a float
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def toml_text(mapping: dict[str, Any], header: Sequence[str] = ()) -> str:
    """``mapping`` (scalars, lists and nested tables) as TOML, after ``header`` comment lines."""
    lines = [f"# {h}" if h else "#" for h in header]

    def table(path: list[str], data: dict[str, Any]) -> None:
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
        if path and scalars:
            lines.extend(["", f"[{'.'.join(path)}]"])
        elif not path and lines:
            lines.append("")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
        for k, v in data.items():
            if isinstance(v, dict):
                table([*path, k], v)

    table([], mapping)
    return "\n".join(lines) + "\n"


def deepspeed_path(out: Path) -> Path:
    """Where the DeepSpeed JSON goes beside ``out``: ``tuned.toml`` -> ``tuned.deepspeed.json``."""
    return out.with_name(f"{out.stem}.deepspeed.json")


def write(
    mapping: dict[str, Any], out: Path, header: Sequence[str]
) -> tuple[Path, Path | None, str | None]:
    """Write the TOML at ``out`` and the DeepSpeed JSON beside it where expressible; returns
    both paths (None for a JSON not written) and why it was not."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(toml_text(mapping, header))
    ds = deepspeed_path(out)
    try:
        data = to_deepspeed(mapping)
    except NotExpressible as e:
        if ds.exists():  # an earlier run's file would now describe another configuration
            ds.unlink()
        return out, None, str(e)
    ds.write_text(json.dumps(data, indent=2) + "\n")
    return out, ds, None
