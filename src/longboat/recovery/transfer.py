"""What a live replica sends a joining rank, as JSON and tensors over the new group.

[Note: what a joiner receives] After a replacement is taken in ([Note: joining a
replacement] in ``joining.py``), the lowest member that was there broadcasts, over the
strategy's ``replica_axis`` (every rank under ``replicate``; under hybrid sharding each place's
group across the replicas, so each joiner hears the rank at its own place), in this order: one
JSON header (the engine's counters, micro-batch and accumulation, each loader's position, the
fp16 loss scaler, and the layout of the optimizer's and the LR scheduler's ``state_dict``),
then the strategy's ``replica_tensors`` (``replicate``: every parameter and buffer; ZeRO: each
unit's flat parameter or shard, and the buffers), in place on every rank, then the tensors of
the optimizer's state (step counts included), then torch's CPU random state. Nothing is
pickled: the header is JSON in a byte tensor, the rest are tensors.
State the engine does not own (the script's own variables, Python's and NumPy's random
generators, a second model) is not carried: see ``docs/recovery.md``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from longboat.comm.protocol import Comm

Carried = dict[str, Any]


def encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` (a ``state_dict``: dicts, lists, tuples, numbers, strings, tensors) as JSON,
    its tensors replaced by their place in ``tensors`` (appended to)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        dtype = str(obj.dtype).removeprefix("torch.")
        return {"t": len(tensors) - 1, "shape": list(obj.shape), "dtype": dtype}
    if isinstance(obj, dict):
        return {"d": [[encode(k, tensors), encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"u": [encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return {"l": [encode(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, bool | int | float | str):
        return {"v": obj}
    raise TypeError(
        f"a {type(obj).__name__} in the optimizer's or scheduler's state_dict cannot be sent "
        "to a joining rank (JSON and tensors only): keep such state out of state_dict()"
    )


def _where(node: Any, device: torch.device) -> torch.device:
    """Where a tensor of ``node`` travels: floating tensors with elements on the model's
    device (the data plane), the rest (step counts, random states) on the CPU."""
    floating = getattr(torch, node["dtype"]).is_floating_point
    return device if floating and node["shape"] else torch.device("cpu")


def layout_places(layout: Any, device: torch.device) -> list[tuple[Any, torch.device]]:
    """Each tensor of ``layout``, in order: its description and where it travels."""
    out: list[tuple[Any, torch.device]] = []

    def walk(node: Any) -> None:
        if "t" in node:
            out.append((node, _where(node, device)))
        for key in ("d", "u", "l"):
            for child in node.get(key, ()):
                for c in child if key == "d" else (child,):
                    walk(c)

    walk(layout)
    return out


def decode(layout: Any, tensors: list[torch.Tensor]) -> Any:
    """The object :func:`encode` described, with ``tensors`` in their places."""
    if "t" in layout:
        return tensors[layout["t"]]
    if "d" in layout:
        return {decode(k, tensors): decode(v, tensors) for k, v in layout["d"]}
    if "u" in layout:
        return tuple(decode(v, tensors) for v in layout["u"])
    if "l" in layout:
        return [decode(v, tensors) for v in layout["l"]]
    return layout["v"]


def broadcast_json(comm: Comm, obj: Any, src: int = 0) -> Any:
    """``obj`` of group rank ``src`` on every rank (two broadcasts: length, then bytes)."""
    data = json.dumps(obj, separators=(",", ":")).encode() if comm.rank == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    comm.broadcast(size, src=src)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if comm.rank == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    comm.broadcast(buf, src=src)
    return json.loads(buf.numpy().tobytes())


def share(
    data: Comm,
    control: Comm,
    header: Carried,
    state: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    device: torch.device,
) -> tuple[Carried, Any, Any, torch.Tensor]:
    """Run [Note: what a joiner receives] on every rank of the group of ``data`` and
    ``control``; ``header`` is rank 0's to send, ``state`` (the strategy's
    ``replica_tensors``) is overwritten with rank 0's in place. Returns, on every rank, as rank
    0 holds them: the header, the optimizer's ``state_dict``, the scheduler's (None without
    one) and torch's CPU random state."""
    sending = control.rank == 0
    sent: list[torch.Tensor] = []
    if sending:
        header = dict(header)
        header["optimizer"] = encode(optimizer.state_dict(), sent)
        header["scheduler"] = None if scheduler is None else encode(scheduler.state_dict(), sent)
        header["rng"] = encode(torch.get_rng_state(), sent)
    header = broadcast_json(control, header)
    with torch.no_grad():
        for t in state:
            data.broadcast(t.data, src=0)
    places = [
        p
        for key in ("optimizer", "scheduler", "rng")
        if header[key] is not None
        for p in layout_places(header[key], device)
    ]
    received = []
    for i, (node, where) in enumerate(places):
        if sending:
            t = sent[i].to(where)
        else:
            t = torch.empty(node["shape"], dtype=getattr(torch, node["dtype"]), device=where)
        (data if where == device and t.dim() else control).broadcast(t, src=0)
        received.append(t)
    rng = decode(header["rng"], received)
    optim = decode(header["optimizer"], received)
    sched = None if header["scheduler"] is None else decode(header["scheduler"], received)
    return header, optim, sched, rng


__all__ = ["broadcast_json", "decode", "encode", "layout_places", "share"]
