"""Saved state read back slice by slice, whatever layout wrote it: the
:class:`~longboat.pieces.PieceSource` a strategy loads from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longboat.checkpoint.errors import CheckpointError
from longboat.checkpoint.manifest import Manifest, TensorEntry
from longboat.checkpoint.tensorfile import TensorFiles
from longboat.pieces import OPTIM, Slices

#: Whole tensors kept after assembling them from sliced shards: a strategy reads a tensor's
#: slices for its keys one after another, so a few suffice.
_KEEP = 4


class ManifestSource:
    """Reads the slices a strategy asks for from the shards a manifest lists."""

    def __init__(self, path: Path, manifest: Manifest, scalars: dict[str, dict[str, Any]]) -> None:
        self.path = path
        self.manifest = manifest
        self._scalars = scalars
        self._files = TensorFiles(path)
        self._aliases = {t.name: t.tied_to for t in manifest.model.tensors if t.tied_to}
        self._whole: dict[tuple[str, str], torch.Tensor] = {}

    def state_keys(self, name: str) -> list[str]:
        return sorted(k for k in self.manifest.tensors.get(name, {}) if k.startswith(OPTIM))

    def scalars(self, name: str) -> dict[str, Any]:
        return self._scalars.get(name, {})

    def read(
        self,
        name: str,
        key: str,
        start: int,
        end: int,
        out: torch.Tensor,
        slices: Slices | None = None,
    ) -> None:
        saved = self._aliases.get(name, name)
        entry = self.manifest.tensors.get(saved, {}).get(key)
        if entry is None:
            raise CheckpointError(f"checkpoint '{self.path}' has no {key} for {name!r}")
        numel = entry.numel if slices is None else slices.numel
        if end > numel or out.numel() != end - start:
            raise CheckpointError(
                f"{key} of {name!r}: asked for elements [{start}, {end}) "
                f"of a saved tensor with {numel}"
            )
        if slices is not None and slices.boxes and len(slices.boxes[0]) != len(entry.shape):
            raise CheckpointError(
                f"{key} of {name!r}: asked for slices of {len(slices.boxes[0])} dimensions "
                f"of a saved tensor of shape {list(entry.shape)}"
            )
        if slices is not None or entry.sliced:
            # Either side counts in n-dimensional slices: go through the whole tensor.
            whole = self._assembled(saved, key, entry)
            local = whole if slices is None else slices.take(whole)
            out.copy_(local.reshape(-1)[start:end])
            return
        for s in entry.shards:
            a, b = max(start, s.start), min(end, s.end)
            if a < b:
                out[a - start : b - start].copy_(
                    self._files.slice(s.file, s.key, a - s.start, b - s.start)
                )

    def _assembled(self, name: str, key: str, entry: TensorEntry) -> torch.Tensor:
        """The whole saved tensor, put together from its shards (the last few are kept)."""
        whole = self._whole.pop((name, key), None)
        if whole is None:
            for s in entry.shards:
                data = self._files.slice(s.file, s.key, 0, s.end - s.start)
                if whole is None:
                    whole = torch.empty(entry.shape, dtype=data.dtype)
                if s.slices is None:
                    whole.view(-1)[s.start : s.end] = data
                elif s.start == 0 and s.end == s.slices.numel:
                    s.slices.put(whole, data.view(s.slices.shape))
                else:
                    local = s.slices.take(whole)
                    local.view(-1)[s.start : s.end] = data
                    s.slices.put(whole, local)
            assert whole is not None, "the manifest's cover check found a shard"
        self._whole[(name, key)] = whole  # most recently used last
        while len(self._whole) > _KEEP:
            self._whole.pop(next(iter(self._whole)))
        return whole

    def close(self) -> None:
        self._whole.clear()
        self._files.close()
