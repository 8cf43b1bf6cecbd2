"""Optimizer state offloaded to disk between steps, for ZeRO stages 1-3.

[Note: optimizer state offload] With ``zero.offload_optimizer.device = "disk"`` a rank keeps each
flat unit's optimizer state (the element-wise tensors of every piece its shard holds: Adam's two
moments, SGD's momentum) in a file of its own, and in memory only while the unit steps. The step
goes unit by unit, as stages 1-2 already do for their all-gathers: the unit's file is read, the
optimizer steps that unit's pieces alone (an element-wise optimizer steps only parameters with a
gradient, so the others keep their state untouched), and its state is written back and dropped.
One I/O thread reads up to ``buffer_count - 1`` units ahead of the one stepping and writes behind
it, so the disk works while the optimizer computes; at most ``buffer_count`` units' state is in
memory at once, plus the ones still being written. Scalars (Adam's ``step``) stay in memory:
bytes per parameter.

Plain ``os.pread``/``os.pwrite`` on whole files, no ``libaio`` and no memory map: a mapped file's
pages count in the process's memory until the kernel evicts them, which defeats a memory budget.

Files are named ``rank<R>.pid<P>.unit<U>.bin`` under ``<path>/longboat-swap``: written before they
are ever read in a run, removed at ``close()``; a file whose process ``P`` no longer runs is a
crashed run's and is removed when the next run starts on that path (a file is never trusted
across runs: state comes back from checkpoints).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from longboat.config import ConfigError
from longboat.strategies.flat import FlatUnit

SWAP_DIR = "longboat-swap"
log = logging.getLogger("longboat")
_KEY = "zero.offload_optimizer"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(directory: Path) -> list[Path]:
    """Remove swap files that a process no longer running left behind; return them."""
    gone = []
    for f in directory.glob("rank*.pid*.unit*.bin"):
        try:
            pid = int(f.name.split(".pid", 1)[1].split(".", 1)[0])
        except ValueError:
            continue
        if not _alive(pid):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
            gone.append(f)
    return gone


def check_room(directory: Path, need: int) -> None:
    """Refuse, before training, a disk with less free space than ``need`` bytes."""
    free = shutil.disk_usage(directory).free
    if free < need:
        raise ConfigError(
            f"{_KEY}.path = {str(directory.parent)!r}: the optimizer state of this rank needs "
            f"{need / 2**20:,.1f} MiB and the disk has {free / 2**20:,.1f} MiB free; choose "
            "a path on a larger disk, or free space"
        )


@dataclass
class _UnitFile:
    """One unit's swap file and what it holds, in order: (piece index, state key, elements,
    dtype) per tensor."""

    path: Path
    layout: list[tuple[int, str, int, torch.dtype]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(n * dt.itemsize for _, _, n, dt in self.layout)


def _as_bytes(t: torch.Tensor) -> Any:
    return t.detach().contiguous().view(torch.uint8).numpy()


class StateSwap:
    """The swap files of one rank's units (see [Note: optimizer state offload])."""

    def __init__(self, cfg: Any, units: list[FlatUnit], rank: int) -> None:
        self.units = units
        self.buffer_count = cfg.buffer_count
        if any(u.device.type != "cpu" for u in units):
            raise ConfigError(
                f"{_KEY}.device = 'disk' with parameters on {units[0].device}: offload to disk "
                "is implemented for CPU training only so far; remove the key"
            )
        self.dir = Path(cfg.path) / SWAP_DIR
        # ``longboat plan`` runs the step on fake tensors: no files then; reads allocate what a
        # real read allocates, and both count their bytes.
        self.dry = any(isinstance(u.shard, FakeTensor) for u in units)
        self.files = {
            u.index: _UnitFile(self.dir / f"rank{rank}.pid{os.getpid()}.unit{u.index}.bin")
            for u in units
        }
        self.scalars: dict[int, dict[str, Any]] = {}  # per piece (its id): non-tensor state
        self.moved = 0  # bytes read and written, in all
        self.stale: list[Path] = []
        if not self.dry:
            self._prepare(cfg.path)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="longboat-swap")

    def _prepare(self, path: str) -> None:
        """The directory made and probed; a crashed run's files removed."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise ConfigError(
                f"{_KEY}.path = {path!r} is not a writable directory ({e.strerror}); give "
                "a directory this process may create files in"
            ) from None
        self.stale = remove_stale(self.dir)
        if self.stale:
            log.warning(
                "zero: removed %d swap file(s) under %s left by a process that no longer runs "
                "(a crashed run's; state comes back from checkpoints)",
                len(self.stale),
                self.dir,
            )

    # -- files ---------------------------------------------------------------------------------

    def _write(self, f: _UnitFile, tensors: list[torch.Tensor]) -> None:
        if self.dry:
            self.moved += sum(t.numel() * t.element_size() for t in tensors)
            return
        fd = os.open(f.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            buffers = [_as_bytes(t) for t in tensors]
            os.pwritev(fd, buffers, 0)
            os.ftruncate(fd, sum(b.nbytes for b in buffers))
        finally:
            os.close(fd)
        self.moved += sum(t.numel() * t.element_size() for t in tensors)

    def _read(self, f: _UnitFile) -> list[torch.Tensor]:
        tensors = [torch.empty(n, dtype=dt) for _, _, n, dt in f.layout]
        if self.dry:
            self.moved += f.nbytes
            return tensors
        fd = os.open(f.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [_as_bytes(t) for t in tensors], 0)
        finally:
            os.close(fd)
        if got != f.nbytes:
            raise RuntimeError(
                f"swap file {f.path} holds {got} bytes where {f.nbytes} were written: it was "
                "changed or truncated while training ran"
            )
        self.moved += got
        return tensors

    # -- optimizer state in and out --------------------------------------------------------------

    def _take(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Remove ``u``'s pieces' state from the optimizer: tensors to write (the file's layout
        follows them), scalars kept here."""
        f = self.files[u.index]
        layout, tensors = [], []
        for j, (*_, piece) in enumerate(u.pieces):
            st = optimizer.state.pop(piece, None)
            if st is None:
                continue
            kept: dict[str, Any] = {}
            for k, v in sorted(st.items()):
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    layout.append((j, k, v.numel(), v.dtype))
                    tensors.append(v)
                else:
                    kept[k] = v
            self.scalars[id(piece)] = kept
        f.layout = layout
        return tensors

    def _put(
        self, u: FlatUnit, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]
    ) -> None:
        """Give ``u``'s pieces their state back, as the file holds it."""
        f = self.files[u.index]
        by_piece: dict[int, dict[str, Any]] = {}
        for (j, k, _, _), t in zip(f.layout, tensors, strict=True):
            piece = u.pieces[j][3]
            by_piece.setdefault(j, dict(self.scalars.get(id(piece), {})))[k] = t.view(piece.shape)
        for j, (*_, piece) in enumerate(u.pieces):
            if j in by_piece:
                optimizer.state[piece] = by_piece[j]
            elif id(piece) in self.scalars and self.scalars[id(piece)]:
                optimizer.state[piece] = dict(self.scalars[id(piece)])

    def _submit(self, fn: Any, *args: Any) -> Future[Any]:
        """On the I/O thread; in the planner's run on this one (its fake tensors are this
        thread's)."""
        if not self.dry:
            return self._io.submit(fn, *args)
        done: Future[Any] = Future()
        done.set_result(fn(*args))
        return done

    def step(self, optimizer: torch.optim.Optimizer, step_unit: Any) -> None:
        """Step every unit with its state brought in (``step_unit(u)`` steps ``u``'s pieces
        only), reading ahead and writing behind on the I/O thread."""
        units = self.units
        reads: dict[int, Future[list[torch.Tensor]]] = {}

        def ahead(i: int) -> None:
            if i < len(units) and self.files[units[i].index].layout:
                reads[i] = self._submit(self._read, self.files[units[i].index])

        for i in range(min(self.buffer_count, len(units))):
            ahead(i)
        writes = []
        for i, u in enumerate(units):
            if i in reads:
                self._put(u, optimizer, reads.pop(i).result())
            step_unit(u)
            tensors = self._take(u, optimizer)
            if tensors:
                writes.append(self._submit(self._write, self.files[u.index], tensors))
            del tensors
            ahead(i + self.buffer_count)
        for w in writes:
            w.result()

    def bring_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Every unit's state into the optimizer (a checkpoint reads it there)."""
        for u in self.units:
            f = self.files[u.index]
            if f.layout:
                self._put(u, optimizer, self._read(f))

    def drop_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Take every unit's state out of memory again; the files hold it unchanged."""
        for u in self.units:
            self._take(u, optimizer)

    def store_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Write every unit's state (loaded from a checkpoint) to its file, out of memory."""
        for u in self.units:
            tensors = self._take(u, optimizer)
            if tensors:
                self._write(self.files[u.index], tensors)

    @property
    def disk_bytes(self) -> int:
        """Bytes of optimizer state in this rank's files."""
        return sum(f.nbytes for f in self.files.values())

    def close(self) -> None:
        """Stop the I/O thread and remove this rank's files."""
        self._io.shutdown(wait=True)
        if self.dry:
            return
        for f in self.files.values():
            with contextlib.suppress(FileNotFoundError):
                f.path.unlink()
        # The directory stays: other ranks share it, and one that has not written its first
        # file yet would find it gone.


__all__ = ["SWAP_DIR", "StateSwap", "check_room", "remove_stale"]
