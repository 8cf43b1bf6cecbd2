"""Saved state read back slice by slice, whatever layout wrote it: the
:class:`~longboat.strategies.pieces.PieceSource` a strategy loads from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longboat.checkpoint.errors import CheckpointError
from longboat.checkpoint.manifest import Manifest
from longboat.checkpoint.tensorfile import TensorFiles
from longboat.strategies.pieces import OPTIM


class ManifestSource:
    """Reads the slices a strategy asks for from the shards a manifest lists."""

    def __init__(self, path: Path, manifest: Manifest, scalars: dict[str, dict[str, Any]]) -> None:
        self.path = path
        self.manifest = manifest
        self._scalars = scalars
        self._files = TensorFiles(path)
        self._aliases = {t.name: t.tied_to for t in manifest.model.tensors if t.tied_to}

    def state_keys(self, name: str) -> list[str]:
        return sorted(k for k in self.manifest.tensors.get(name, {}) if k.startswith(OPTIM))

    def scalars(self, name: str) -> dict[str, Any]:
        return self._scalars.get(name, {})

    def read(self, name: str, key: str, start: int, end: int, out: torch.Tensor) -> None:
        entry = self.manifest.tensors.get(self._aliases.get(name, name), {}).get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint '{self.path}' has no {key} for {name!r}")
        if end > entry.numel or out.numel() != end - start:
            raise CheckpointError(
                f"{key} of {name!r}: asked for elements [{start}, {end}) "
                f"of a saved tensor with {entry.numel}"
            )
        for s in entry.shards:
            a, b = max(start, s.start), min(end, s.end)
            if a < b:
                out[a - start : b - start].copy_(
                    self._files.slice(s.file, s.key, a - s.start, b - s.start)
                )

    def close(self) -> None:
        self._files.close()
