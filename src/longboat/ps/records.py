"""What a parameter server holds and knows: its settings, each key's range (values, optimizer,
summed pushes), each worker's record, and a key's state as it travels for checkpoints.

The modes these serve are [Note: parameter server modes] in ``server.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from longboat.ps.layout import KeyLayout, Segment

#: ``(key, group, tensors) -> optimizer`` over a key's segments on this server; ``group`` is
#: what the worker declared with the key (the engine: its parameter group's index).
OptimizerFactory = Callable[[int, int, list[torch.Tensor]], "torch.optim.Optimizer | None"]


@dataclass
class Held:
    """One key's range on this server."""

    layout: KeyLayout
    segments: list[Segment]
    values: list[torch.Tensor]
    optimizer: torch.optim.Optimizer | None = None
    initialized: bool = False
    version: int = 0  # clocks applied (sync, ssp) or pushes applied (async)
    acc: dict[int, torch.Tensor] = field(default_factory=dict)  # clock -> summed push
    who: dict[int, set[int]] = field(default_factory=dict)  # clock -> workers that pushed it
    mean: torch.Tensor | None = None  # without update_on_server: the last mean gradient
    lr: float | None = None  # the learning rate the last push carried

    @property
    def span(self) -> int:
        return sum(s.numel for s in self.segments)


@dataclass
class WorkerRecord:
    """What a server knows of one worker."""

    rank: int
    pushes: int = 0
    pulls: int = 0
    clock: int = 0  # pushes of the most pushed key (a worker pushes every key each step)
    last_seen: float = 0.0
    finished: bool = False
    dead: bool = False
    host: str = ""  # where it ran, as it said when it left
    error: str | None = None  # why it left, when it left by failing (see Op.BYE)
    max_staleness: int = 0

    def live(self) -> bool:
        return not (self.finished or self.dead)


@dataclass(frozen=True)
class Settings:
    """How a server behaves (from ``[parameter_server]``)."""

    mode: str = "sync"
    staleness: int = 0
    update_on_server: bool = True
    dead_after_s: float = 10.0


def held_pushes(settings: Settings) -> int:
    """How many summed pushes of one key a server may hold at once, each its range of the key
    and a flag per segment (see [Note: parameter server modes]): none in ``async`` (each is
    applied as it comes), the clock being summed in ``sync``, up to ``staleness + 1`` clocks in
    ``ssp``; and without ``update_on_server`` the last mean gradient besides."""
    waiting = {"async": 0, "sync": 1, "ssp": settings.staleness + 1}[settings.mode]
    return waiting + (0 if settings.update_on_server else 1)


# -- a key's state (checkpoints) -------------------------------------------------------------


def state_of(held: Held, clocks: list[int]) -> tuple[dict[str, Any], torch.Tensor]:
    """A key's range on this server as it travels: a description (version, every worker's
    clock, each segment's optimizer state by name) and one flat tensor (the values, then each
    tensor of the optimizer state, in the key's dtype)."""
    tensors: list[torch.Tensor] = list(held.values)
    segments: list[dict[str, Any]] = []
    for seg, v in zip(held.segments, held.values, strict=True):
        state: dict[str, Any] = {}
        opt_state = held.optimizer.state.get(v, {}) if held.optimizer is not None else {}
        for name, x in opt_state.items():
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                state[name] = {"numel": x.numel(), "dtype": str(x.dtype).removeprefix("torch.")}
                tensors.append(x.reshape(-1).to(held.values[0].dtype))
            elif isinstance(x, torch.Tensor):
                state[name] = {"scalar": x.item(), "dtype": str(x.dtype).removeprefix("torch.")}
            else:
                state[name] = {"value": x}
        segments.append({"index": seg.index, "start": seg.start, "end": seg.end, "state": state})
    meta = {"version": held.version, "clocks": clocks, "segments": segments}
    return meta, torch.cat([t.reshape(-1) for t in tensors])


def restore(held: Held, meta: dict[str, Any], flat: torch.Tensor) -> list[int]:
    """Load what :func:`state_of` gave into ``held`` (its pushes in progress dropped);
    returns every worker's clock."""
    offset = 0
    for v in held.values:
        v.copy_(flat[offset : offset + v.numel()])
        offset += v.numel()
    held.initialized = True
    held.version = int(meta["version"])
    held.acc.clear()
    held.who.clear()
    clocks = [int(c) for c in meta["clocks"]]
    if held.optimizer is None:
        return clocks
    for seg_meta, v in zip(meta["segments"], held.values, strict=True):
        state: dict[str, Any] = {}
        for name, spec in seg_meta["state"].items():
            if "numel" in spec:
                n = int(spec["numel"])
                state[name] = flat[offset : offset + n].to(getattr(torch, spec["dtype"])).clone()
                offset += n
            elif "scalar" in spec:
                state[name] = torch.tensor(spec["scalar"], dtype=getattr(torch, spec["dtype"]))
            else:
                state[name] = spec["value"]
        if state:
            held.optimizer.state[v] = state
        else:
            held.optimizer.state.pop(v, None)
    return clocks
