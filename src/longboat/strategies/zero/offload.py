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
State is read into blocks of the home's pool and goes back to it once written ([Note: reused
blocks] in ``blocks.py``). Where the user set neither ``foreach`` nor ``fused``, Adam and AdamW
step with torch's fused CPU kernel, which allocates nothing per parameter
(:func:`~longboat.strategies.zero.cpu_step.prefer_cpu_kernels`).

Files are named ``rank<R>.pid<P>.unit<U>.bin`` under ``<path>/longboat-swap``: written before they
are ever read in a run, removed at ``close()``; a file whose process ``P`` no longer runs is a
crashed run's and is removed when the next run starts on that path (a file is never trusted
across runs: state comes back from checkpoints).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor

from longboat.config.errors import ConfigError
from longboat.config.sections_parallel import swap_path_problem
from longboat.strategies.zero.blocks import Blocks
from longboat.strategies.zero.flat import FlatUnit

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
    """The bytes of a contiguous CPU tensor as a writable buffer, for ``pwritev``/``preadv``.
    Through ctypes, not ``numpy()``: a storage numpy has seen can no longer be resized, and
    [Note: parameter offload] frees shards by resizing their storage."""
    assert t.is_contiguous()
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def open_dir(path: str, key: str) -> Path:
    """``<path>/longboat-swap``, made and probed; a crashed run's files in it removed.

    ``path`` itself may be made, its parent must exist ([Note: offload path]); checked when the
    config loads, and again here, where a directory removed since would be made again."""
    problem = swap_path_problem(path)
    if problem:
        raise ConfigError(f"{key}.path = {path!r}: {problem}")
    directory = Path(path).absolute() / SWAP_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{key}.path = {path!r} is not a writable directory ({e.strerror}); give "
            "a directory this process may create files in"
        ) from None
    stale = remove_stale(directory)
    if stale:
        log.warning(
            "zero: removed %d swap file(s) under %s left by a process that no longer runs "
            "(a crashed run's; state comes back from checkpoints)",
            len(stale),
            directory,
        )
    return directory


class SwapFiles:
    """Whole-file reads and writes of tensors, and the bytes they moved. ``dry`` (the
    planner's run on fake tensors): no file is touched, reads allocate what a real read
    allocates, and both count their bytes."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.read_bytes = 0
        self.written_bytes = 0
        self._lock = threading.Lock()  # reads and writes count from two threads

    @property
    def moved(self) -> int:
        """Bytes read and written, in all."""
        return self.read_bytes + self.written_bytes

    def _count(self, n: int, written: bool) -> None:
        with self._lock:
            if written:
                self.written_bytes += n
            else:
                self.read_bytes += n

    def write(self, path: Path, tensors: list[torch.Tensor]) -> None:
        n = sum(t.numel() * t.element_size() for t in tensors)
        if not self.dry:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                tensors = [t.detach().contiguous() for t in tensors]  # alive while written
                os.pwritev(fd, [_as_bytes(t) for t in tensors], 0)
                os.ftruncate(fd, n)
            finally:
                os.close(fd)
        self._count(n, written=True)

    def read_into(self, path: Path, tensors: list[torch.Tensor]) -> None:
        """Fill ``tensors`` (contiguous) from the file, which must hold exactly their bytes."""
        n = sum(t.numel() * t.element_size() for t in tensors)
        if not self.dry:
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [_as_bytes(t) for t in tensors], 0)
            finally:
                os.close(fd)
            if got != n:
                raise RuntimeError(
                    f"swap file {path} holds {got} bytes where {n} were written: it was "
                    "changed or truncated while training ran"
                )
        self._count(n, written=False)


class UnitHome(Protocol):
    """One part of a unit's state on disk (its optimizer state, its shards) as the
    :class:`UnitStream` moves it; the disk home ([Note: homes] in ``homes.py``) holds one per
    part."""

    def bring(self, u: FlatUnit) -> Any:
        """On the I/O thread, ahead of ``u``'s step: read what the step needs."""

    def install(self, u: FlatUnit, optimizer: torch.optim.Optimizer, brought: Any) -> None:
        """Before ``u`` steps: put what :meth:`bring` read where the optimizer finds it."""

    def take(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> Any:
        """After ``u`` stepped: take out what goes back to disk."""

    def store(self, u: FlatUnit, taken: Any) -> None:
        """On the I/O thread: write it."""


class UnitStream:
    """Steps units one by one with their offloaded parts brought in: each home's :meth:`bring`
    runs on one I/O thread up to ``ahead`` units ahead of the unit stepping, and its
    :meth:`store` behind it, so the disk works while the optimizer computes."""

    def __init__(
        self,
        homes: list[UnitHome],
        units: list[FlatUnit],
        ahead: int,
        dry: bool,
        io_thread: bool = True,
    ) -> None:
        self.homes = homes
        self.units = units
        self.ahead = ahead
        self.dry = dry
        # Without one (homes whose bring and store only start asynchronous copies, [Note:
        # host offload] in ``host.py``), everything runs on this thread.
        self._io = ThreadPoolExecutor(1, thread_name_prefix="longboat-swap") if io_thread else None

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        """On the I/O thread; in the planner's run, or without an I/O thread, on this one (the
        planner's fake tensors are this thread's)."""
        if not self.dry and self._io is not None:
            return self._io.submit(fn, *args)
        done: Future[Any] = Future()
        done.set_result(fn(*args))
        return done

    def step(self, optimizer: torch.optim.Optimizer, step_unit: Any) -> None:
        """``step_unit(u)`` for every unit (it steps ``u``'s pieces only), each with its state
        brought in around it."""
        units, homes = self.units, self.homes
        reads: dict[int, Future[list[Any]]] = {}

        def ahead(i: int) -> None:
            if i < len(units):
                reads[i] = self.submit(lambda u: [h.bring(u) for h in homes], units[i])

        def store(u: FlatUnit, taken: list[Any]) -> None:
            for h, t in zip(homes, taken, strict=True):
                h.store(u, t)

        for i in range(min(self.ahead, len(units))):
            ahead(i)
        writes = []
        for i, u in enumerate(units):
            for h, b in zip(homes, reads.pop(i).result(), strict=True):
                h.install(u, optimizer, b)
            step_unit(u)
            taken = [h.take(u, optimizer) for h in homes]
            writes.append(self.submit(store, u, taken))
            del taken
            ahead(i + self.ahead)
        for w in writes:
            w.result()

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)


class StateSwap(SwapFiles):
    """The optimizer-state swap files of one rank's units (see [Note: optimizer state
    offload]): a :class:`UnitHome`."""

    def __init__(self, cfg: Any, units: list[FlatUnit], rank: int, blocks: Blocks) -> None:
        self.units = units
        self.blocks = blocks  # [Note: reused blocks] in ``blocks.py``
        super().__init__(dry=any(isinstance(u.shard, FakeTensor) for u in units))
        self.dir = Path(cfg.path) / SWAP_DIR
        if not self.dry:
            self.dir = open_dir(cfg.path, _KEY)
        self.files = {
            u.index: _UnitFile(self.dir / f"rank{rank}.pid{os.getpid()}.unit{u.index}.bin")
            for u in units
        }
        self.scalars: dict[int, dict[str, Any]] = {}  # per piece (its id): non-tensor state

    def _read(self, f: _UnitFile) -> list[torch.Tensor]:
        tensors = [self.blocks.take(n, dt) for _, _, n, dt in f.layout]
        self.read_into(f.path, tensors)
        return tensors

    # -- optimizer state in and out --------------------------------------------------------------

    def take(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
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

    def install(
        self, u: FlatUnit, optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor] | None
    ) -> None:
        """Give ``u``'s pieces their state back, as the file holds it."""
        if tensors is None:
            return
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

    def bring(self, u: FlatUnit) -> list[torch.Tensor] | None:
        f = self.files[u.index]
        return self._read(f) if f.layout else None  # no state yet: the first step

    def store(self, u: FlatUnit, tensors: list[torch.Tensor]) -> None:
        """Write ``u``'s state, taken from the optimizer after its step, and give its memory
        to the pool: nothing else holds it then."""
        if tensors:
            self.write(self.files[u.index].path, tensors)
            for t in tensors:
                self.blocks.recycle(t)

    def bring_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Every unit's state into the optimizer (a checkpoint reads it there)."""
        for u in self.units:
            self.install(u, optimizer, self.bring(u))

    def drop_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Take every unit's state out of memory again; the files hold it unchanged."""
        for u in self.units:
            self.take(u, optimizer)

    def store_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Write every unit's state (loaded from a checkpoint) to its file, out of memory."""
        for u in self.units:  # not through store: a checkpoint's loader may hold them still
            tensors = self.take(u, optimizer)
            if tensors:
                self.write(self.files[u.index].path, tensors)

    @property
    def disk_bytes(self) -> int:
        """Bytes of optimizer state in this rank's files."""
        return sum(f.nbytes for f in self.files.values())

    def close(self) -> None:
        """Remove this rank's files."""
        if self.dry:
            return
        for f in self.files.values():
            with contextlib.suppress(FileNotFoundError):
                f.path.unlink()
        # The directory stays: other ranks share it, and one that has not written its first
        # file yet would find it gone.


__all__ = [
    "SWAP_DIR",
    "StateSwap",
    "SwapFiles",
    "UnitHome",
    "UnitStream",
    "check_room",
    "open_dir",
    "remove_stale",
]
