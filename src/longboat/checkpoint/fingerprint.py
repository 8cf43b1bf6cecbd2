"""The model fingerprint: which model a checkpoint belongs to.

It is the SHA-256 of the sorted list of (name, full shape, dtype, tied-to) of every entry of the
model's ``state_dict`` (parameters and persistent buffers), taken before a strategy shards
anything. Sorted, so the order in which a model registers its modules does not matter (loading
is by name); with ``tied-to``, so a model that shares a weight between two names differs from one
that does not (a checkpoint stores a tied tensor once). Names and shapes cannot tell two
same-shaped layers apart: a checkpoint whose tensors were swapped between such names is caught by
the SHA-256 of each tensor in the manifest instead (see ``manifest.py``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorSpec:
    """One ``state_dict`` entry as the fingerprint sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    tied_to: str | None = None  # the first name of a tensor shared by several names

    def row(self) -> list[object]:
        return [self.name, list(self.shape), self.dtype, self.tied_to]


@dataclass(frozen=True)
class ModelSpec:
    """Names, full shapes and dtypes of a model's state, and its fingerprint."""

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, model: nn.Module, shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelSpec:
        """The spec of ``model`` as it is now (take it before a strategy shards parameters);
        ``shapes``: the full shapes of tensors held in parts (tensor parallelism), by name."""
        shapes = shapes or {}
        first: dict[int, str] = {}
        out = []
        for name, t in model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                continue
            tied = first.setdefault(id(t), name)
            out.append(
                TensorSpec(
                    name,
                    shapes.get(name, tuple(t.shape)),
                    dtype_name(t.dtype),
                    tied if tied != name else None,
                )
            )
        return cls(tuple(out))

    @classmethod
    def from_rows(cls, rows: list[list[object]]) -> ModelSpec:
        """The inverse of :meth:`rows` (as read from a manifest)."""
        specs = []
        for name, shape, dtype, tied in rows:
            dims = tuple(int(d) for d in shape)  # type: ignore[attr-defined]
            specs.append(
                TensorSpec(str(name), dims, str(dtype), None if tied is None else str(tied))
            )
        return cls(tuple(specs))

    def rows(self) -> list[list[object]]:
        return [t.row() for t in self.tensors]

    @property
    def fingerprint(self) -> str:
        text = json.dumps(sorted(self.rows(), key=lambda r: str(r[0])), separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def differences(self, model: ModelSpec, limit: int = 8) -> list[str]:
        """How ``model`` (the one loading) differs from this spec (the checkpoint's), as lines
        naming each parameter; at most ``limit`` lines plus a count of the rest."""
        ours = {t.name: t for t in self.tensors}
        theirs = {t.name: t for t in model.tensors}
        lines = [
            f"{n!r} is in the checkpoint but not in the model" for n in ours if n not in theirs
        ]
        lines += [
            f"{n!r} is in the model but not in the checkpoint" for n in theirs if n not in ours
        ]
        for n, a in ours.items():
            b = theirs.get(n)
            if b is None:
                continue
            if (a.shape, a.dtype) != (b.shape, b.dtype):
                lines.append(
                    f"{n!r}: checkpoint {a.dtype}{list(a.shape)}, model {b.dtype}{list(b.shape)}"
                )
            elif a.tied_to != b.tied_to:
                lines.append(
                    f"{n!r}: tied to {a.tied_to!r} in the checkpoint, to {b.tied_to!r} in the model"
                )
        if len(lines) > limit:
            lines = [*lines[:limit], f"... and {len(lines) - limit} more"]
        return lines


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
