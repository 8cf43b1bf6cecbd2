"""What a rank records about each collective it issues: operation, shapes, dtype, group, and the
user's source line that caused it.

Kept small and cheap: a :class:`CallRecord` is built only when the desync check or the comm log is
on, and the source line comes from a plain ``sys._getframe`` walk (a few microseconds).
"""

from __future__ import annotations

import os
import sys
import traceback
import zlib
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import torch

# Frames under these directories are "ours" (or torch's), not the user's.
_LONGBOAT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_COMM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# Operation codes for fingerprints; order is part of the fingerprint format.
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "all_to_all")
REDUCE_OPS = ("", "sum", "max", "min")
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
FINGERPRINT_LEN = 13

# [Note: lone forwards] A forward outside training (under no_grad or in eval mode) may be run by
# some ranks only, an evaluation on rank 0, say; one that issues collectives (ZeRO-3's gathers)
# then pairs its collectives with whatever the other ranks do next, and those may even agree in
# shape (the same unit gathered for their next training forward, or by engine.close()), so that
# the ranks drift apart until a raw abort or a lost peer far from the cause. Its caller appends
# this to the collective's tag: the tag is part of the fingerprint, so the first such collective
# already differs from any other rank's, and the fingerprint's last field says so, so that every
# rank's DesyncError can name the cause and its fix, even from a peer's fingerprint alone.
LONE_FORWARD = "in a forward outside training"


@dataclass(frozen=True)
class CallRecord:
    """One collective as this rank issued it."""

    seq: int  # 1-based count of collectives issued through this doorway
    op: str
    dtype: str
    shape: tuple[int, ...]  # the tensor a reader thinks of: the input (output for all_gather)
    out_shape: tuple[int, ...] | None  # the other side of all_gather/reduce_scatter
    reduce_op: str
    group: str
    source: str  # the user's line, e.g. "train.py:42 in main"
    caller: str  # longboat's function that issued it, e.g. "Replicate._launch"
    # What the tensor is, when ranks could pass same-shaped tensors of different things (e.g.
    # "unit 4 (moe)" for a ZeRO-3 gather); part of the fingerprint.
    tag: str = ""

    def signature(self) -> str:
        """``all_reduce(float32[4])``, with the other shape for gather/scatter and the tag."""
        if self.dtype == "-":
            return f"{self.op}()"
        dims = ",".join(map(str, self.shape))
        other = f" -> [{','.join(map(str, self.out_shape))}]" if self.out_shape is not None else ""
        red = f", {self.reduce_op}" if self.reduce_op not in ("", "sum") else ""
        tag = f" [{self.tag}]" if self.tag else ""
        return f"{self.op}({self.dtype}[{dims}]{other}{red}){tag}"

    def describe(self) -> str:
        """``all_reduce(float32[4]) #7 at train.py:42 in main``."""
        via = f" via {self.caller}" if self.caller else ""
        return f"{self.signature()} #{self.seq} at {self.source}{via}"

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def where_called(depth: int = 2) -> tuple[str, str]:
    """(the user's source line, longboat's calling function) for the current collective.

    The user's line is the first frame outside longboat and torch; longboat's caller is the first
    frame in longboat outside ``comm/``. Hooks run by autograd on another thread have no user
    frame; then the source is ``<no user frame>``.
    """
    frame: FrameType | None = sys._getframe(depth)
    caller = ""
    while frame is not None:
        fname = frame.f_code.co_filename
        if fname.startswith(_LONGBOAT_DIR):
            if not caller and not fname.startswith(_COMM_DIR):
                caller = frame.f_code.co_qualname
        elif not fname.startswith(_TORCH_DIR) and not fname.startswith("<frozen"):
            return f"{os.path.basename(fname)}:{frame.f_lineno} in {frame.f_code.co_name}", caller
        frame = frame.f_back
    return "<no user frame>", caller


def python_stack(limit: int = 12) -> str:
    """This thread's Python stack without the frames of ``comm/`` (which only report) and of
    torch (autograd's machinery between ``engine.backward`` and a gradient hook says nothing)."""
    frames = [
        f for f in traceback.extract_stack() if not f.filename.startswith((_COMM_DIR, _TORCH_DIR))
    ]
    return "".join(traceback.format_list(frames[-limit:]))


def fingerprint(rec: CallRecord, src: int) -> list[int]:
    """A fixed-length integer summary of ``rec``: equal on every rank iff they agree."""
    shape = list(rec.shape[:3]) + [-1] * (3 - min(len(rec.shape), 3))
    if len(rec.shape) > 3:  # fold the rest so that any difference still shows
        rest = 1
        for d in rec.shape[3:]:
            rest *= d
        shape.append(rest)
    else:
        shape.append(-1)
    out = rec.out_shape or ()
    out_numel = 1
    for d in out:
        out_numel *= d
    try:
        dt = _DTYPES.index(getattr(torch, rec.dtype))
    except (AttributeError, ValueError):  # no tensor ("-"), or a rare dtype: a stable code
        dt = len(_DTYPES) + zlib.crc32(rec.dtype.encode())
    return [
        rec.seq,
        OPS.index(rec.op),
        REDUCE_OPS.index(rec.reduce_op),
        dt,
        len(rec.shape),
        *shape,
        out_numel if rec.out_shape is not None else -1,
        src,
        zlib.crc32(rec.tag.encode()) if rec.tag else 0,
        int(rec.tag.endswith(LONE_FORWARD)),  # [Note: lone forwards]
    ]


def describe_fingerprint(fp: tuple[int, ...] | list[int]) -> str:
    """What a fingerprint says of its collective, e.g. ``all_reduce(float32[100])`` (a peer's,
    when only its fingerprint is known; the tag is a checksum, shown as such)."""
    op = OPS[fp[1]] if 0 <= fp[1] < len(OPS) else f"op {fp[1]}"
    red = REDUCE_OPS[fp[2]] if 0 <= fp[2] < len(REDUCE_OPS) else "?"
    dt = dtype_name(_DTYPES[fp[3]]) if 0 <= fp[3] < len(_DTYPES) else "another dtype"
    ndim = fp[4]
    dims = [str(d) for d in fp[5 : 5 + min(ndim, 3)]]
    if ndim > 3:
        dims.append(f"...({fp[8]} more elements)")
    red_text = f", {red}" if red not in ("", "sum") else ""
    tag = f" [tag {fp[11]:08x}{', ' + LONE_FORWARD if fp[12] else ''}]" if fp[11] else ""
    if op == "barrier":
        return "barrier()"
    return f"{op}({dt}[{','.join(dims)}]{red_text}){tag}"
