"""Durable writes: flushed, fsync'd, then renamed into place, so a crash leaves the old file or
the new one, never half of one. JSON only: nothing longboat writes or reads is a pickle."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from longboat.checkpoint.errors import CheckpointError


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be
    opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller renames it into place if needed)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_durably(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` by a file holding ``data`` (write-temp-then-rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write_bytes_durably(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def to_json_bytes(obj: Any, what: str) -> bytes:
    """``obj`` as JSON, refusing anything JSON cannot hold (so nothing needs a pickle); the
    error names the key path inside ``what``."""
    _check_json(obj, what)
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def _check_json(obj: Any, where: str) -> None:
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return  # NaN and infinities are written as NaN/Infinity, which Python's json reads back
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(
                    f"{where} has a key {k!r} of type {type(k).__name__}; JSON keys must be strings"
                )
            _check_json(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json(v, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__name__}, which a checkpoint cannot hold: it stores JSON "
        "(numbers, strings, lists, dicts) and tensors only, never pickles. Convert it (e.g. "
        "tensor.tolist()) or save tensors through the model"
    )


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON file; errors name the file."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{what} '{path}' is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"{what} '{path}' is not valid JSON ({e}); the file is damaged "
            "or was not written by longboat"
        ) from None
