"""What is allocated at the CUDA peak, from the caching allocator's own record.

``torch.cuda.memory._record_memory_history`` records every allocation and free with the Python
frames that made it; replaying that record finds the moment of the peak and the blocks alive
then. They are grouped by where they were made (the innermost frame outside torch, then the
innermost frame): a tensor made by autograd's engine thread has no Python frame and shows as
``backward (no Python frame)``. The planner traces the step on the CPU; where its peak and the
measured one disagree, this says what the GPU's peak holds that the trace's does not.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

TOP = 15  # groups kept, largest first


@contextmanager
def recorded(device: torch.device) -> Iterator[dict[str, Any]]:
    """Record the allocator's history inside the block (CUDA only); the dict it yields gets
    ``peak_bytes``, ``at_peak`` and ``live_at_peak`` on leaving."""
    found: dict[str, Any] = {}
    if device.type != "cuda":
        yield found
        return
    history = torch.cuda.memory._record_memory_history
    history(enabled="all", context="alloc", stacks="python", max_entries=1_000_000)
    try:
        yield found
        trace = torch.cuda.memory._snapshot(device)["device_traces"][device.index or 0]
    finally:
        history(enabled=None)
    found.update(composition(trace))


def _where(event: dict[str, Any]) -> str:
    frames = event.get("frames") or []
    if not frames:
        return "backward (no Python frame)"
    ours = [f for f in frames if "/torch/" not in f["filename"]]
    first, inner = (ours or frames)[0], frames[0]
    name = f"{first['filename'].rsplit('/', 1)[-1]}:{first['line']} {first['name']}"
    if inner is not first:
        name += f" <- {inner['filename'].rsplit('/', 1)[-1]}:{inner['line']} {inner['name']}"
    return name


def composition(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """The peak of the allocated bytes over ``trace`` (from where the record began) and the
    blocks alive at it, grouped by :func:`_where`."""
    live: dict[int, dict[str, Any]] = {}
    now = peak = 0
    at_peak: dict[int, dict[str, Any]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            now -= live.pop(event["addr"])["size"]
    size: collections.Counter[str] = collections.Counter()
    blocks: collections.Counter[str] = collections.Counter()
    for event in at_peak.values():
        size[_where(event)] += event["size"]
        blocks[_where(event)] += 1
    return {
        "peak_bytes": peak,
        "live_at_peak": [
            {"where": k, "bytes": v, "blocks": blocks[k]} for k, v in size.most_common(TOP)
        ],
    }
