"""ZeRO-3's parameter and gradient shards offloaded to disk between uses.

[Note: parameter offload] With ``zero.offload_param.device = "disk"`` (stage 3) a rank keeps each
flat unit's parameter shard and gradient shard in files of their own and in memory only while
they are used:

- forward and backward: a unit's parameter shard is read just before its gather and dropped as
  soon as the gather is over (the gathered full unit lives as long as without offload);
- each reduction of a unit's gradients lands in a shard-size buffer that is written to the unit's
  gradient file (after adding what the file holds from earlier micro-batches of the step) and
  dropped once written; the sum of its squares is kept, so clipping needs no second pass over the
  disk: the norm is known when the backward ends, and the clipping factor is applied as each
  unit's gradient is brought in for the step;
- the step goes unit by unit (:class:`~longboat.strategies.zero.offload.UnitStream`): the
  parameter and gradient shards are read ahead on the I/O thread with the optimizer state (when
  that is offloaded too), the optimizer steps the unit, and the parameter shard is written back
  and dropped behind it.

A shard "dropped" keeps its tensor and every view of it (the optimizer's pieces, [Note: shard
pieces] in ``flat.py``) and hands its memory to the home's pool of blocks, from which the next
shard of its size is filled ([Note: reused blocks] in ``blocks.py``); the reductions' buffers
come from that pool and go back to it once written. Files
follow [Note: optimizer state offload] in ``zero/offload.py``:
``rank<R>.pid<P>.unit<U>.param.bin`` and ``.grad.bin``, written before they are read, removed
at ``close()`` and, after a crash, by the next run on that path.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from longboat.strategies.zero.blocks import Blocks
from longboat.strategies.zero.flat import FlatUnit, element_size
from longboat.strategies.zero.offload import SWAP_DIR, SwapFiles, open_dir
from longboat.strategies.zero.storage import has_storage

_KEY = "zero.offload_param"


class ShardSwap(SwapFiles):
    """The parameter and gradient shards of one rank's stage-3 units, on disk (see [Note:
    parameter offload]): a :class:`~longboat.strategies.zero.offload.UnitHome`. ``submit``
    runs a function on the I/O thread shared with the optimizer state's swap."""

    def __init__(self, cfg: Any, rank: int, dry: bool, blocks: Blocks) -> None:
        super().__init__(dry)
        self.blocks = blocks  # [Note: reused blocks]
        self.units: list[FlatUnit] = []
        self.submit: Any = None  # set by the strategy to its stream's
        self.limit = cfg.buffer_count  # gradient writes in flight at most
        self.dir = Path(cfg.path) / SWAP_DIR
        if not dry:
            self.dir = open_dir(cfg.path, _KEY)
        self.stem = f"rank{rank}.pid{os.getpid()}"
        self.param_files: dict[int, Path] = {}
        self.grad_files: dict[int, Path] = {}
        # The optimizer's gradient views, cut once while the gradient shard has its memory
        # (a view of a dropped tensor cannot be made, but one made before stays valid).
        self.grad_pieces: dict[int, list[torch.Tensor]] = {}
        self.has_grad: set[int] = set()  # units whose gradient file holds this step's sum
        self.squares: dict[int, torch.Tensor] = {}  # per unit: its gradient's sum of squares
        self.coef: torch.Tensor | None = None  # clipping, applied as each gradient comes in
        self._writes: dict[int, Future[Any]] = {}  # a unit's gradient write in flight
        self._written: set[int] = set()  # units whose gradient file exists

    def adopt(self, u: FlatUnit) -> None:
        """Take a unit just built: its parameter shard to its file, both shards out of memory
        (one unit at a time, so that setup stays within what one unit needs)."""
        assert u.shard is not None and u.grad_shard is not None
        self.units.append(u)
        self.param_files[u.index] = self.dir / f"{self.stem}.unit{u.index}.param.bin"
        self.grad_files[u.index] = self.dir / f"{self.stem}.unit{u.index}.grad.bin"
        self.grad_pieces[u.index] = [u.grad_shard[a:b] for _, a, b, _ in u.pieces]
        self.write(self.param_files[u.index], [u.shard])
        self.blocks.free(u.shard)
        self.blocks.free(u.grad_shard)

    # -- parameters around their gathers --------------------------------------------------------

    def bring_param(self, u: FlatUnit) -> None:
        """``u``'s parameter shard into memory (read now), unless it is there."""
        assert u.shard is not None
        if not has_storage(u.shard):
            self.blocks.fill(u.shard)
            self.read_into(self.param_files[u.index], [u.shard])

    def drop_param(self, u: FlatUnit) -> None:
        """Out of memory again; the file holds it unchanged."""
        assert u.shard is not None
        self.blocks.free(u.shard)

    # -- gradients as they are reduced ---------------------------------------------------------

    def land(self, u: FlatUnit, reduced: torch.Tensor) -> None:
        """``reduced`` (this micro-batch's reduced gradient shard) joins the file's sum."""
        pending = self._writes.pop(u.index, None)
        if pending is not None:
            pending.result()
        if u.index in self.has_grad:
            earlier = self.blocks.take(reduced.numel(), reduced.dtype)
            self.read_into(self.grad_files[u.index], [earlier])
            reduced.add_(earlier)
            self.blocks.recycle(earlier)
            del earlier
        self.has_grad.add(u.index)
        self.squares[u.index] = torch.linalg.vector_norm(reduced, dtype=torch.float32).square()
        while len(self._writes) >= self.limit:  # bound the buffers waiting for the disk
            self._writes.pop(next(iter(self._writes))).result()
        self._writes[u.index] = self.submit(self._write_gradient, u, reduced)
        self._written.add(u.index)

    def _write_gradient(self, u: FlatUnit, reduced: torch.Tensor) -> None:
        """On the I/O thread: the reduced shard to its file, its memory back to the pool (the
        reduction's buffer is nobody else's once landed)."""
        self.write(self.grad_files[u.index], [reduced])
        self.blocks.recycle(reduced)

    def gradient_squares(self) -> torch.Tensor:
        """The sum of squares of every unit's gradient shard (after the step's last reduction)."""
        self.wait_writes()
        total = torch.zeros((), dtype=torch.float32)
        for sq in self.squares.values():
            total += sq
        return total

    def scale_gradients(self, coef: torch.Tensor) -> None:
        """Multiply every gradient shard by ``coef`` (applied as each is brought in)."""
        self.coef = coef if self.coef is None else self.coef * coef

    def wait_writes(self) -> None:
        for w in self._writes.values():
            w.result()
        self._writes.clear()

    # -- the step (a UnitHome) -------------------------------------------------------------------

    def bring(self, u: FlatUnit) -> None:
        assert u.shard is not None and u.grad_shard is not None
        self.bring_param(u)
        self.blocks.fill(u.grad_shard)
        if u.index in self.has_grad:
            self.read_into(self.grad_files[u.index], [u.grad_shard])
        else:  # not reduced this step (no backward ran): nothing was added to it
            u.grad_shard.zero_()

    def install(self, u: FlatUnit, optimizer: torch.optim.Optimizer, brought: None) -> None:
        if self.coef is not None:
            assert u.grad_shard is not None
            u.grad_shard.mul_(self.coef.to(u.grad_shard.dtype))

    def take(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> None:
        assert u.grad_shard is not None
        self.blocks.free(u.grad_shard)  # the step consumed it; the next step starts from zero
        self.has_grad.discard(u.index)
        self.squares.pop(u.index, None)

    def store(self, u: FlatUnit, taken: None) -> None:
        assert u.shard is not None
        self.write(self.param_files[u.index], [u.shard])
        self.blocks.free(u.shard)

    def step_over(self) -> None:
        """After every unit stepped."""
        self.coef = None

    # -- all at once (checkpoints) --------------------------------------------------------------

    def bring_all_params(self) -> None:
        for u in self.units:
            self.bring_param(u)

    def drop_all_params(self) -> None:
        for u in self.units:
            self.drop_param(u)

    def store_all_params(self) -> None:
        """Write every parameter shard (loaded from a checkpoint) and drop it."""
        for u in self.units:
            self.store(u, None)

    # -- accounting -------------------------------------------------------------------------

    @property
    def disk_bytes(self) -> dict[str, int]:
        """Bytes in this rank's files: parameter shards, and gradient shards (each file written
        by the first reduction of its unit, rewritten from then on)."""
        size = {u.index: u.shard_numel * element_size(u.dtype) for u in self.units}
        return {
            "parameters": sum(size.values()),
            "gradients": sum(size[i] for i in self._written),
        }

    def close(self) -> None:
        """Remove this rank's files."""
        self.wait_writes()
        if self.dry:
            return
        for f in [*self.param_files.values(), *self.grad_files.values()]:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()


__all__ = ["ShardSwap"]
