"""The manifest: what a checkpoint holds, and the checksums that prove it is intact.

``manifest.json`` records the format version; the model's fingerprint and its table of (name,
full shape, dtype, tied-to); the strategy and world size that wrote the checkpoint; the step; for
every tensor (a model tensor, key ``model``, or an element-wise optimizer state, key
``optim.<state>``) its full shape, dtype and the shards that hold it, each a flat ``[start, end)``
slice with the file, the key inside the file and the SHA-256 of its bytes (a shard of a
tensor-parallel rank also has ``slices``: the n-dimensional slices of the full tensor its
``[start, end)`` counts in, see ``Slices`` in ``pieces.py``); and the size and
SHA-256 of every file. It carries the SHA-256 of its own canonical JSON (``checksum``), so a
damaged manifest is refused rather than believed.

What is caught, and how: a truncated, extended or bit-flipped file by its size and SHA-256 (and
the tensor inside it whose bytes changed, by that tensor's SHA-256); a missing file by name; two
tensors swapped inside a file (e.g. the weights of two same-shaped layers) by the file's SHA-256
and by the SHA-256 of each of the two tensors; a manifest edited by hand or damaged, by its own
checksum; a checkpoint of another model, by the fingerprint (see ``fingerprint.py``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longboat.checkpoint.errors import CheckpointError
from longboat.checkpoint.fingerprint import ModelSpec
from longboat.checkpoint.fsio import read_json
from longboat.pieces import Slices

FORMAT = "longboat-checkpoint"
#: Version 2 adds a shard's ``slices``; a checkpoint without any is still written as version 1
#: (an older longboat reads it), one with them as 2 (an older longboat refuses it rather than
#: reading its ranges as flat ones).
VERSION = 2
READABLE = (1, 2)
_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")  # plain names: no path can escape


@dataclass(frozen=True)
class Shard:
    """Elements ``[start, end)`` of a flattened tensor, stored under ``key`` in ``file``."""

    file: str
    key: str
    start: int
    end: int
    sha256: str
    #: the slices of the full tensor ``[start, end)`` counts in; None: the full tensor
    slices: Slices | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file,
            "key": self.key,
            "start": self.start,
            "end": self.end,
            "sha256": self.sha256,
        }
        if self.slices is not None:
            out["slices"] = self.slices.to_json()
        return out


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    shards: tuple[Shard, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def sliced(self) -> bool:
        """True when some shard counts in slices (written by tensor-parallel ranks)."""
        return any(s.slices is not None for s in self.shards)


@dataclass(frozen=True)
class Manifest:
    """A parsed, self-consistent manifest (see the module docstring)."""

    tag: str
    step: int
    strategy: str
    world_size: int
    model: ModelSpec
    fingerprint: str
    tensors: dict[str, dict[str, TensorEntry]]  # name -> key -> entry
    files: dict[str, dict[str, Any]]  # file name -> {"sha256": ..., "bytes": ...}
    created: float

    def to_json(self) -> dict[str, Any]:
        sliced = any(e.sliced for keys in self.tensors.values() for e in keys.values())
        body = {
            "format": FORMAT,
            "version": VERSION if sliced else 1,
            "tag": self.tag,
            "step": self.step,
            "strategy": self.strategy,
            "world_size": self.world_size,
            "created": self.created,
            "model": {"fingerprint": self.fingerprint, "tensors": self.model.rows()},
            "tensors": {
                n: {
                    k: {
                        "shape": list(e.shape),
                        "dtype": e.dtype,
                        "shards": [s.to_json() for s in e.shards],
                    }
                    for k, e in keys.items()
                }
                for n, keys in self.tensors.items()
            },
            "files": self.files,
        }
        return {**body, "checksum": _digest(body)}


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    ).hexdigest()


def read_manifest(path: Path) -> Manifest:
    """Read and check ``path`` (its own checksum, structure, and that every tensor is fully
    covered by shards in listed files); errors name the file and what is wrong."""
    raw = read_json(path, "checkpoint manifest")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' is not a longboat checkpoint manifest")
    if raw.get("version") not in READABLE:
        raise CheckpointError(
            f"'{path}' has format version {raw.get('version')!r}; this "
            f"longboat reads versions {', '.join(map(str, READABLE))}: use a matching longboat"
        )
    body = {k: v for k, v in raw.items() if k != "checksum"}
    if raw.get("checksum") != _digest(body):
        raise CheckpointError(
            f"'{path}' does not match its own checksum: the manifest was "
            "damaged or edited; the checkpoint cannot be trusted"
        )
    try:
        return _parse(body, path)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"'{path}' is malformed ({type(e).__name__}: {e})") from None


def _parse(body: dict[str, Any], path: Path) -> Manifest:
    files = {
        str(f): {"sha256": str(v["sha256"]), "bytes": int(v["bytes"])}
        for f, v in body["files"].items()
    }
    for f in files:
        if not _FILE.fullmatch(f):
            raise CheckpointError(f"'{path}' lists a file {f!r} that is not a plain file name")
    model = ModelSpec.from_rows(body["model"]["tensors"])
    if model.fingerprint != body["model"]["fingerprint"]:
        raise CheckpointError(
            f"'{path}': the recorded fingerprint does not match the recorded "
            "model table; the manifest is inconsistent"
        )
    tensors: dict[str, dict[str, TensorEntry]] = {}
    for name, keys in body["tensors"].items():
        for key, e in keys.items():
            shards = tuple(
                Shard(
                    str(s["file"]),
                    str(s["key"]),
                    int(s["start"]),
                    int(s["end"]),
                    str(s["sha256"]),
                    Slices.from_json(s["slices"]) if "slices" in s else None,
                )
                for s in e["shards"]
            )
            entry = TensorEntry(tuple(int(d) for d in e["shape"]), str(e["dtype"]), shards)
            _check_cover(path, name, key, entry, files)
            tensors.setdefault(str(name), {})[str(key)] = entry
    for t in model.tensors:
        if t.tied_to is None and "model" not in tensors.get(t.name, {}):
            raise CheckpointError(f"'{path}' has no data for model tensor {t.name!r}")
    return Manifest(
        str(body["tag"]),
        int(body["step"]),
        str(body["strategy"]),
        int(body["world_size"]),
        model,
        model.fingerprint,
        tensors,
        files,
        float(body.get("created", 0.0)),
    )


def _check_cover(path: Path, name: str, key: str, e: TensorEntry, files: dict[str, Any]) -> None:
    for s in e.shards:
        if s.file not in files:
            raise CheckpointError(
                f"'{path}': {key} of {name!r} points at {s.file!r}, which the "
                "manifest does not list"
            )
    if e.sliced:
        _check_sliced_cover(path, name, key, e)
        return
    pos = 0
    for s in sorted(e.shards, key=lambda s: s.start):
        if s.start > pos:
            break
        pos = max(pos, s.end)
    if pos < e.numel:
        raise CheckpointError(
            f"'{path}': elements [{pos}, {e.numel}) of {key} of {name!r} are "
            "in no shard; the checkpoint is incomplete"
        )


def _check_sliced_cover(path: Path, name: str, key: str, e: TensorEntry) -> None:
    """Coverage when shards count in slices: mark each shard's elements in a mask of the full
    tensor (one byte per element, for checkpoints written by tensor-parallel ranks only)."""
    import torch

    seen = torch.zeros(e.shape, dtype=torch.bool)
    for s in e.shards:
        sl = s.slices
        if sl is not None and not all(_inside(b, e.shape) for b in sl.boxes):
            raise CheckpointError(
                f"'{path}': {key} of {name!r} has slices outside its shape {list(e.shape)}"
            )
        numel = e.numel if sl is None else sl.numel
        if not 0 <= s.start <= s.end <= numel:
            raise CheckpointError(
                f"'{path}': {key} of {name!r} has a shard [{s.start}, {s.end}) outside its "
                f"{numel} elements"
            )
        if sl is None:
            seen.view(-1)[s.start : s.end] = True
        else:
            local = sl.take(seen)
            local.view(-1)[s.start : s.end] = True
            sl.put(seen, local)
    if not bool(seen.all()):
        missing = int((~seen).sum())
        raise CheckpointError(
            f"'{path}': {missing} elements of {key} of {name!r} are in no shard; the "
            "checkpoint is incomplete"
        )


def _inside(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> bool:
    return len(box) == len(shape) and all(
        o >= 0 and n >= 0 and o + n <= d for (o, n), d in zip(box, shape, strict=True)
    )
