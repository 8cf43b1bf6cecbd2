"""What an engine keeps for its checkpoints between saves: the model's spec (taken before a
strategy shards the parameters), the loaders whose position a checkpoint records, and the stop
signals that ask for a final checkpoint."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from torch import nn

from longboat.checkpoint.exchange import gather_json
from longboat.checkpoint.fingerprint import ModelSpec
from longboat.checkpoint.preemption import StopSignals
from longboat.comm.protocol import Comm


class Resumable(Protocol):
    """A loader whose position can be saved and restored (``ShardedLoader``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


L = TypeVar("L", bound=Resumable)


class Checkpointing:
    """Per-engine checkpoint bookkeeping."""

    def __init__(
        self,
        model: nn.Module,
        stages: Comm | None = None,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        """``stages``: the doorway over the pipeline stages (each holding some of the model's
        layers); the spec is then the whole model's, every stage's tensors in stage order, so a
        checkpoint's names and fingerprint do not depend on how many stages wrote it.
        ``shapes``: full shapes of the tensors this rank holds parts of (tensor parallelism)."""
        spec = ModelSpec.of(model, shapes)
        if stages is not None and stages.world_size > 1:
            rows: dict[str, list[object]] = {}
            for part in gather_json(stages, spec.rows()):
                for r in part:  # a weight tied across stages is on each of its holders, alike
                    rows.setdefault(str(r[0]), r)
            spec = ModelSpec.from_rows(list(rows.values()))
        self.spec = spec
        self.stop = StopSignals()
        self._loaders: list[weakref.ref[Any]] = []
        # Positions loaded before their loader existed: applied when the loader is created, in
        # creation order (the usual script loads the checkpoint, then builds its loader).
        self._pending: list[dict[str, Any] | None] = []

    def track(self, loader: L) -> L:
        """Record ``loader``'s position in every checkpoint; resume it if one was loaded."""
        self._loaders = [r for r in self._loaders if r() is not None]
        i = len(self._loaders)
        self._loaders.append(weakref.ref(loader))
        if i < len(self._pending) and self._pending[i] is not None:
            loader.load_state_dict(self._pending[i])  # type: ignore[arg-type]
            self._pending[i] = None
        return loader

    def loader_states(self) -> list[dict[str, Any]]:
        return [lo.state_dict() for r in self._loaders if (lo := r()) is not None]

    def load_loader_states(self, states: list[dict[str, Any]]) -> None:
        live = [lo for r in self._loaders if (lo := r()) is not None]
        for lo, st in zip(live, states, strict=False):
            lo.load_state_dict(st)
        self._pending = [None] * len(live) + list(states[len(live) :])
