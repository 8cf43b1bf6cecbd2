"""Small metadata exchanged between ranks as JSON in a byte tensor, never as a pickle (torch's
``all_gather_object`` unpickles what peers send; RELIABILITY.md asks for tensors and JSON only
on the wire)."""

from __future__ import annotations

import json
from typing import Any

import torch

from longboat.comm.protocol import Comm


def gather_json(comm: Comm, obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order, on every rank (tuples come back as lists).

    Two collectives: the longest encoding (MAX), then an all-gather of the padded bytes.
    """
    if comm.world_size == 1:
        return [json.loads(json.dumps(obj))]
    data = json.dumps(obj, separators=(",", ":")).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    comm.all_reduce(size, op="max")
    n = int(size.item())
    mine = torch.zeros(n + 8, dtype=torch.uint8)  # 8 bytes of length, then the text
    mine[: 8 + len(data)] = torch.frombuffer(
        bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8
    )
    every = torch.empty((n + 8) * comm.world_size, dtype=torch.uint8)
    comm.all_gather(every, mine)
    out = []
    for chunk in every.view(comm.world_size, n + 8):
        raw = chunk.numpy().tobytes()
        length = int.from_bytes(raw[:8], "little")
        out.append(json.loads(raw[8 : 8 + length]))
    return out
