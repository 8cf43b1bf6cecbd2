"""Horovod's elastic API (``hvd.elastic.run``, ``hvd.elastic.TorchState``) on longboat's restarts.

[Note: elastic on restarts] Horovod keeps the surviving workers alive when a host is lost,
restores the last committed state in memory and goes on with fewer (or, later, more) workers.
longboat's jobs have a fixed size: when a worker fails, ``longboat run --max-restarts K``
restarts every worker of the job. So a commit here is written to disk as well, by rank 0, into
``$LONGBOAT_STATE_DIR`` (``longboat run`` sets it to a directory that lives as long as the
launch, across its restarts), atomically; ``run`` loads the last commit at the start of every
attempt and broadcasts it from rank 0, then calls the training function. A script written for
Horovod's elastic mode thus resumes from its last ``commit()`` after a failure, with the same
world size. Without ``LONGBOAT_STATE_DIR`` (another launcher), commits stay in memory, as
``restore()`` needs them, and a restart starts over.

Not here: adding or removing hosts while the job runs (``check_host_updates`` never finds any),
``HostsUpdatedInterrupt``.
"""

from __future__ import annotations

import copy
import functools
import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STATE_DIR_VAR = "LONGBOAT_STATE_DIR"
_FILE = "horovod_elastic_state.pt"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast_object(obj: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if _rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class State:
    """Horovod's ``State``: what ``commit`` saves and ``restore`` brings back, plus any
    attributes given as keyword arguments (``epoch=0, batch=0``), which are committed too."""

    def __init__(self, **kwargs: Any) -> None:
        self._extras = list(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)
        self._reset_callbacks: list[Callable[[], None]] = []
        self._saved: dict[str, Any] | None = None

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Called after a restore (Horovod calls them when the world changed; here, on restart)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def check_host_updates(self) -> None:
        """Horovod raises when hosts were added or removed; a longboat job's hosts are fixed."""

    def _capture(self) -> dict[str, Any]:
        return {"extras": {k: copy.deepcopy(getattr(self, k)) for k in self._extras}}

    def _apply(self, saved: dict[str, Any]) -> None:
        for key, value in saved["extras"].items():
            setattr(self, key, copy.deepcopy(value))

    def save(self) -> None:
        """Keep the current state in memory (what ``restore`` returns to)."""
        self._saved = self._capture()

    def restore(self) -> None:
        """Go back to the last ``save``/``commit``."""
        if self._saved is not None:
            self._apply(self._saved)

    def commit(self) -> None:
        """Save, and on rank 0 write it to ``$LONGBOAT_STATE_DIR`` for a restarted attempt."""
        self.save()
        directory = os.environ.get(STATE_DIR_VAR)
        if directory and _rank() == 0 and self._saved is not None:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            torch.save(self._saved, buf)
            tmp = path / f".{_FILE}.tmp"
            with open(tmp, "wb") as f:
                f.write(buf.getvalue())
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path / _FILE)  # a restart sees the old commit or the new, never half

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        self._apply(_broadcast_object(self._capture()))

    def _load_commit(self) -> bool:
        """Rank 0 reads the last commit of this launch, if any; True when one was read."""
        directory = os.environ.get(STATE_DIR_VAR)
        found = False
        if directory and _rank() == 0 and (Path(directory) / _FILE).is_file():
            saved = torch.load(Path(directory) / _FILE, weights_only=False)
            self._apply(saved)
            found = True
        return bool(_broadcast_object(found))


class ObjectState(State):
    """Horovod's ``ObjectState``: only keyword-argument attributes."""


class TorchState(State):
    """Horovod's ``TorchState``: a model's and an optimizer's state, and keyword attributes."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.optimizer = optimizer

    def _capture(self) -> dict[str, Any]:
        out = super()._capture()
        if self.model is not None:
            out["model"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            out["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        return out

    def sync(self) -> None:
        """Rank 0's model by tensor broadcasts (no pickling of weights), the rest as objects."""
        if self.model is not None and dist.is_initialized() and dist.get_world_size() > 1:
            for tensor in self.model.state_dict().values():
                dist.broadcast(tensor, src=0)
        rest = State._capture(self)
        if self.optimizer is not None:
            rest["optimizer"] = self.optimizer.state_dict()
        self._apply(_broadcast_object(rest))

    def _apply(self, saved: dict[str, Any]) -> None:
        super()._apply(saved)
        if self.model is not None and "model" in saved:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and "optimizer" in saved:
            self.optimizer.load_state_dict(saved["optimizer"])


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``@hvd.elastic.run``: ``func(state, ...)`` from the last commit of this launch
    (see [Note: elastic on restarts]), every rank starting from rank 0's state."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if state._load_commit():
            state.on_reset()
        state.sync()
        state.save()
        return func(state, *args, **kwargs)

    return wrapper
