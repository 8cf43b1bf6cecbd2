"""Tensor files in the safetensors format, written and checked in one streaming pass each.

longboat writes the format itself (8-byte header length, JSON header, raw little-endian data) so
that each tensor goes from its own memory to the file with no staging copy, and so that the file's
SHA-256 and every tensor's SHA-256 are computed from the very bytes written. Reading goes through
the ``safetensors`` library (``safe_open``), which validates the header and reads only the slices
asked for. Neither side involves pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longboat.checkpoint.errors import CheckpointError

if TYPE_CHECKING:
    from safetensors import safe_open

# safetensors' dtype names.
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_CHUNK = 8 << 20


@dataclass
class FileRecord:
    """What the manifest records of one file."""

    sha256: str
    bytes: int
    tensors: dict[str, str] = field(default_factory=dict)  # key -> SHA-256 of its bytes


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor, without a copy when it is already contiguous on the CPU."""
    if t.dtype not in DTYPE_NAMES:
        raise CheckpointError(
            f"tensors of dtype {t.dtype} cannot be checkpointed yet; "
            f"supported: {', '.join(str(d) for d in DTYPE_NAMES)}"
        )
    t = t.detach().reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # ndarray.data: the array's buffer as a memoryview (numpy types __buffer__ from 3.12 only)
    return t.view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def write_tensors(
    path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None
) -> FileRecord:
    """Write 1-D-flattened ``tensors`` (key, tensor) to ``path`` as safetensors and fsync it.

    Tensors are stored with their own shape. Returns the SHA-256 of the file and of each
    tensor's bytes.
    """
    header: dict[str, object] = {"__metadata__": metadata or {}}
    offset = 0
    for key, t in tensors:
        if key in header:
            raise CheckpointError(f"tensor key {key!r} appears twice in '{path.name}'")
        n = t.numel() * t.element_size()
        header[key] = {
            "dtype": DTYPE_NAMES.get(t.dtype, str(t.dtype)),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data starts 8-byte aligned, as safetensors does
    head = struct.pack("<Q", len(text)) + text
    whole = hashlib.sha256(head)
    record = FileRecord("", len(head) + offset)
    # hashlib and file writes release the GIL: each tensor's own hash runs in a thread beside
    # the write and the file's hash, on machines with a core to spare.
    # At most two tensors' bytes are held at a time (a GPU tensor's are a host copy).
    with open(path, "wb") as f, ThreadPoolExecutor(1) as pool:
        f.write(head)
        pending: deque[tuple[str, Future[Any]]] = deque()
        for key, t in tensors:
            raw = _raw(t)
            pending.append((key, pool.submit(hashlib.sha256, raw)))
            f.write(raw)
            whole.update(raw)
            while len(pending) > 1:
                k, h = pending.popleft()
                record.tensors[k] = h.result().hexdigest()
        record.tensors.update((k, h.result().hexdigest()) for k, h in pending)
        f.flush()
        os.fsync(f.fileno())
    record.sha256 = whole.hexdigest()
    return record


def write_json(path: Path, data: bytes) -> FileRecord:
    """Write ``data`` (JSON bytes) to ``path``, fsync'd; its record for the manifest."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(hashlib.sha256(data).hexdigest(), len(data))


def checksum(path: Path, per_tensor: bool = False) -> FileRecord:
    """SHA-256 of a file, streamed; with ``per_tensor``, also of each tensor in it when it
    parses as safetensors (to name what changed in a file that failed its check)."""
    whole = hashlib.sha256()
    size = path.stat().st_size
    record = FileRecord("", size)
    with open(path, "rb") as f:
        spans = _spans(f, size, whole) if per_tensor and path.suffix == ".safetensors" else []
        for key, n in spans:
            h = hashlib.sha256()
            while n > 0:
                chunk = f.read(min(n, _CHUNK))
                if not chunk:
                    break
                n -= len(chunk)
                h.update(chunk)
                whole.update(chunk)
            record.tensors[key] = h.hexdigest()
        while chunk := f.read(_CHUNK):
            whole.update(chunk)
    record.sha256 = whole.hexdigest()
    return record


def _spans(f: Any, size: int, whole: Any) -> list[tuple[str, int]]:
    """Read a safetensors header (hashing it) and return (key, byte length) in file order;
    empty if the header is damaged (the file checksum then tells)."""
    head = f.read(8)
    whole.update(head)
    if len(head) < 8:
        return []
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        return []
    text = f.read(n)
    whole.update(text)
    try:
        header = json.loads(text)
        entries = sorted(
            (v["data_offsets"][0], v["data_offsets"][1], k)
            for k, v in header.items()
            if k != "__metadata__"
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    spans, pos = [], 0
    for a, b, k in entries:
        if a != pos or b < a:
            return []  # holes or overlaps: not a file longboat wrote
        spans.append((k, b - a))
        pos = b
    return spans


class TensorFiles:
    """Open safetensors files by name (each once) and read slices of their tensors."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._open: dict[str, safe_open] = {}

    def slice(self, file: str, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the 1-D tensor ``key`` in ``file``."""
        from safetensors import safe_open

        handle = self._open.get(file)
        if handle is None:
            try:
                handle = self._open[file] = safe_open(str(self.root / file), framework="pt")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise CheckpointError(
                    f"'{self.root / file}' cannot be read as safetensors: {e}"
                ) from None
        # safetensors' stub leaves get_slice unannotated; its slices are torch tensors here
        part: torch.Tensor = handle.get_slice(key)[start:end]  # type: ignore[no-untyped-call]
        return part

    def close(self) -> None:
        self._open.clear()
