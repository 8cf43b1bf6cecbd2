"""Offline tools on a checkpoint, without an engine or processes: what it holds
(``longboat checkpoint inspect``) and plain full weights (``longboat checkpoint consolidate``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from longboat.checkpoint import layout
from longboat.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from longboat.checkpoint.manifest import Manifest, read_manifest
from longboat.checkpoint.source import ManifestSource
from longboat.checkpoint.tensorfile import write_tensors
from longboat.checkpoint.verify import file_problems
from longboat.pieces import MODEL


def locate(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory: ``path`` itself if it holds a manifest, else the checkpoint
    ``path/latest`` names (or the newest complete one)."""
    p = Path(path)
    if (p / layout.MANIFEST).is_file():
        return p
    tag = layout.resolve(p, None) if p.is_dir() else None
    if tag is None:
        raise CheckpointNotFoundError(
            f"'{p}' is neither a checkpoint (no {layout.MANIFEST}) nor a directory of checkpoints"
        )
    return p / tag


@dataclass(frozen=True)
class Description:
    """What ``inspect`` reports; ``verified`` is False if anything failed a check."""

    text: str
    verified: bool


def describe(path: str | os.PathLike[str]) -> Description:
    """Tag, step, writer, files (checked against their SHA-256) and tensors of a checkpoint."""
    where = locate(path)
    try:
        m = read_manifest(where / layout.MANIFEST)
    except CheckpointError as e:
        return Description(f"checkpoint {where}\n  NOT VERIFIED: {e}", False)
    problems = file_problems(where, m, sorted(m.files))
    total = sum(int(f["bytes"]) for f in m.files.values())
    lines = [
        f"checkpoint {where}",
        f"  tag {m.tag!r}, step {m.step}, written by {m.strategy} at world size {m.world_size}",
        f"  model fingerprint {m.fingerprint} ({len(m.model.tensors)} tensors, "
        f"{_model_numel(m):,} elements)",
        f"  {len(m.files)} files, {total:,} bytes: "
        + ("all match their SHA-256" if not problems else "NOT VERIFIED"),
        *(f"    {p}" for p in problems),
    ]
    rows = [("tensor", "state", "shape", "dtype", "shards")]
    rows += [
        (name, key, str(list(e.shape)), e.dtype, str(len(e.shards)))
        for name, keys in sorted(m.tensors.items())
        for key, e in sorted(keys.items())
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += [
        "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    return Description("\n".join(lines), not problems)


def _model_numel(m: Manifest) -> int:
    return sum(e.numel for keys in m.tensors.values() for k, e in keys.items() if k == MODEL)


def consolidate(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model's full weights (every ``state_dict`` key, tied ones under each name) to
    ``out`` as a plain safetensors file that ``model.load_state_dict`` accepts after
    ``safetensors.torch.load_file``. The checkpoint is verified first."""
    where = locate(path)
    m = read_manifest(where / layout.MANIFEST)
    problems = file_problems(where, m, sorted(m.files))
    if problems:
        raise CheckpointError("checkpoint files failed verification:\n  " + "\n  ".join(problems))
    # Through the loader's source: shards that count in tensor-parallel slices are put back
    # in their places.
    saved = ManifestSource(where, m, {})
    full: dict[str, torch.Tensor] = {}
    try:
        for t in m.model.tensors:
            source = t.tied_to or t.name
            if source in full:
                full[t.name] = full[source]
                continue
            e = m.tensors[source][MODEL]
            flat = torch.empty(e.numel, dtype=getattr(torch, e.dtype))
            saved.read(source, MODEL, 0, e.numel, flat)
            full[t.name] = flat.view(e.shape)
    finally:
        saved.close()
    target = Path(out)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    write_tensors(
        tmp,
        list(full.items()),
        {
            "format": "pt",
            "longboat_tag": m.tag,
            "longboat_step": str(m.step),
            "longboat_fingerprint": m.fingerprint,
        },
    )
    os.replace(tmp, target)
    return target
