"""ZeRO's master shards and optimizer state in host memory beside an accelerator (ZeRO-Offload).

[Note: host offload] With ``zero.offload_optimizer.device = "cpu"`` and units on an accelerator,
each unit's *master* (a host copy of its parameter shard, in the shard's dtype) and the optimizer
state of its pieces live in host memory, pinned where CUDA is so that copies to and from the
device run asynchronously, and the optimizer the user built steps the masters on the CPU:

- the optimizer's pieces ([Note: shard pieces] in ``flat.py``) are cut from the master, not
  from the device shard, so the optimizer and its state never touch the device; checkpoints read
  and load the masters;
- gradients stay on the device until the step: reductions land in the device gradient shard as
  in memory, and the engine's unscaling, norm and clipping see them there (their all-reduce is a
  data-plane collective, on the device). Each unit's shard is copied to a host gradient buffer
  at the step, after all of that: the replicas' average ([Note: hybrid sharding] in
  ``strategy.py``), one rank's accumulation without a reduction, and clipping all change the
  shard after its last reduction landed, so a copy made as it lands would be stale;
- units step one by one through a :class:`~longboat.strategies.zero.offload.UnitStream` without
  its I/O thread (the copies are asynchronous themselves): unit ``i + 1``'s gradient copy is
  started before unit ``i`` steps, and unit ``i``'s master is copied back into its device shard
  (cast to the shard's dtype) as soon as it stepped (``stepped``), before stages 1-2 all-gather
  it, so the copies in both directions overlap the CPU's step of the next unit; the step ends
  when the last copy back is over, so the masters are the optimizer's alone again.

On CUDA the copies run on a side stream that waits for the compute stream before it reads a
gradient or writes a shard; the CPU waits for a gradient's copy before stepping on it; the
compute stream waits for each copy back (an all-gather, the next forward read the new shard);
``record_stream`` tells the allocator which device tensors the side stream used. Optimizer
state that torch creates (at a piece's first step) or a checkpoint loads is moved to pinned host
memory once.

[Note: host copies on CPU] On a CPU rank, ``offload_optimizer.device = "cpu"`` is where the state
is already, so ``homes.build`` keeps it in memory with the parameters: no copy, no extra memory.
Built on a CPU rank anyway (``homes.build(..., host_copies=True)``, what the tests use), this
home keeps distinct host buffers and copies synchronously in the order it copies beside an
accelerator, so a copy made too early or too late (a stale gradient, a master copied back before
its step) changes the results the tests compare with the plain PyTorch loop.

[Note: host parameter offload] With ``zero.offload_param.device = "cpu"`` and
``zero.offload_optimizer.device = "cpu"`` at stage 3 on an accelerator, a unit's parameter
shard lives on the device only while it is gathered: the master of [Note: host offload] (a
host copy in the shard's dtype, pinned where CUDA is, which the optimizer steps) is the only
copy between uses, so the device holds the gathered units in use, their gradient
buffers, and activations, and nothing per parameter of the rest of the model:

- before its gather a unit's shard gets its memory back and the master is copied in ([Note:
  storage resize] in ``storage.py``); once the gather is over (one rank: once the unit is
  freed, the shard being the gathered unit) its memory goes again. The copy starts on the side
  stream after what the compute stream has queued, and the compute stream waits for it only
  where the shard is first read (``param_ready``: before the all-gather, or one rank's forward
  of the unit), so the copy of a prefetched unit runs under the compute of the unit before;
- each reduction of a unit's gradients is copied out to the unit's host gradient buffer as it
  lands (added to what earlier micro-batches of the step left there) and its device buffer goes;
  the sum of squares of the landed shard is kept, so the engine's clipping needs no second pass
  (:class:`~longboat.grads.HeldGradients`), and the clipping factor is applied on the host as
  each unit's turn to step comes;
- units step on the host one by one as under [Note: host offload], each after its gradient's
  copy is over; nothing is copied back, the next gather reads the master;
- the engine's ``close()`` hands the parameters back in host memory, gathered one unit at a
  time: the model need not fit on the device whole.

The replicas' average of hybrid sharding and fp16's overflow check change or read every
gradient shard after it landed, which here is on the host: both are refused by name ([Note:
compositions]). On a CPU rank ``offload_param.device = "cpu"`` is where the shards are already
(no copy is made); the tests build this home there with real copies ([Note: host copies on
CPU]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from longboat.pieces import RankState
from longboat.placement import host_made
from longboat.strategies.zero.cpu_step import prefer_cpu_kernels
from longboat.strategies.zero.flat import FlatUnit, UnitState
from longboat.strategies.zero.in_memory import InMemory, wait_reduction
from longboat.strategies.zero.offload import UnitStream
from longboat.strategies.zero.policy import ZeroPolicy
from longboat.strategies.zero.storage import alloc_storage, free_storage, has_storage

if TYPE_CHECKING:  # named in a signature only (the import would deepen the import floors)
    from longboat.strategies.base import StrategyContext
    from longboat.strategies.zero.home import StepUnit

#: Units whose gradients are copied out before the one stepping finished: one ahead.
AHEAD = 2


class Copies:
    """Copies between a rank's device tensors and host buffers: on a side stream where the
    device is CUDA, plain synchronous copies elsewhere ([Note: host offload])."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]

    def out(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying device ``src`` into host ``dst``; what :meth:`wait` takes."""
        if self.side is None:
            dst.copy_(src)
            return None
        self.side.wait_stream(torch.cuda.current_stream(src.device))  # src is final there
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
            src.record_stream(self.side)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.side)
        return done

    def wait(self, done: torch.cuda.Event | None) -> None:
        """The CPU waits until the copy :meth:`out` started is over."""
        if done is not None:
            done.synchronize()

    def back(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy host ``src`` into device ``dst`` (cast to its dtype); the compute stream
        waits for it, the CPU does not."""
        self.arrived(self.start_back(src, dst), dst.device)

    def start_back(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event | None:
        """Start copying host ``src`` into device ``dst`` after what the compute stream has
        queued; what :meth:`arrived` takes. Nobody waits for it yet."""
        if self.side is None:
            dst.copy_(src)
            return None
        self.side.wait_stream(torch.cuda.current_stream(dst.device))  # nothing reads old dst
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
            dst.record_stream(self.side)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.side)
        return done

    def arrived(self, done: torch.cuda.Event | None, device: torch.device) -> None:
        """The compute stream waits for a copy :meth:`start_back` started (the CPU does not)."""
        if done is not None:
            torch.cuda.current_stream(device).wait_event(done)

    def drain(self) -> None:
        """Every copy over (the host buffers may be changed again)."""
        if self.side is not None:
            self.side.synchronize()


class OnHost(InMemory):
    """Masters and optimizer state in (pinned) host memory, gradients and parameters on the
    device ([Note: host offload]); what stays on the device is handled as :class:`InMemory`
    does. Also a :class:`~longboat.strategies.zero.offload.UnitHome` of its own stream."""

    steps_by_unit = True

    def __init__(self, ctx: StrategyContext, policy: ZeroPolicy) -> None:
        super().__init__(ctx, policy)
        self.pin = torch.cuda.is_available()
        self.masters: dict[int, torch.Tensor] = {}  # per unit: its master shard, on the host
        self.grads: dict[int, torch.Tensor] = {}  # per unit: its gradient shard, on the host
        self.copies: Copies | None = None
        self.stream: UnitStream | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def _host(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like ``like``, pinned where CUDA is (not in the planner's run,
        whose tensors are fake)."""
        pin = self.pin and not isinstance(like, FakeTensor)
        buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
        return host_made(buffer)  # [Note: planning host offload] in placement.py

    def adopt(self, u: FlatUnit) -> None:
        super().adopt(u)
        assert u.shard is not None
        master = self._host(u.shard)
        master.copy_(u.shard)
        self.masters[u.index] = master
        self.grads[u.index] = self._host(u.shard)
        u.make_pieces(master)  # the optimizer steps the master ([Note: shard pieces])

    def start(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        if not self.units:
            return
        self.copies = Copies(self.units[0].device)
        dry = any(isinstance(u.shard, FakeTensor) for u in self.units)
        self.stream = UnitStream([self], self.units, AHEAD, dry, io_thread=False)
        prefer_cpu_kernels(optimizer)  # the planner's run too: its host memory is the kernel's

    # -- the step --------------------------------------------------------------------------------

    def grad_pieces(self, u: FlatUnit) -> list[torch.Tensor]:
        grad = self.grads[u.index]  # filled when the unit's turn to step comes
        return [grad[a:b] for _, a, b, _ in u.pieces]

    def step(self, optimizer: torch.optim.Optimizer, step_unit: StepUnit) -> None:
        if self.stream is None:
            return
        assert self.copies is not None
        try:
            self.stream.step(optimizer, step_unit)
        finally:
            self.copies.drain()

    def bring(self, u: FlatUnit) -> torch.cuda.Event | None:
        """Ahead of ``u``'s step: its gradient shard (final: reduced, averaged, clipped) out."""
        assert self.copies is not None
        return self.copies.out(u.grad_view(), self.grads[u.index])

    def install(
        self, u: FlatUnit, optimizer: torch.optim.Optimizer, brought: torch.cuda.Event | None
    ) -> None:
        assert self.copies is not None
        self.copies.wait(brought)

    def stepped(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> None:
        """The updated master into the device shard, and new state to pinned memory."""
        assert self.copies is not None and u.shard is not None
        self.copies.back(self.masters[u.index], u.shard)
        self._home_state(u, optimizer)

    def take(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> None:
        return None  # the master stays here, and went back to the device when stepped

    def store(self, u: FlatUnit, taken: None) -> None:
        pass

    def _home_state(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> None:
        """``u``'s pieces' optimizer state on the host, pinned where CUDA is (torch makes it
        where the piece is, at its first step; a checkpoint loads it on the unit's device)."""
        for *_, piece in u.pieces:
            st: dict[str, Any] = optimizer.state.get(piece, {})
            for k, v in st.items():
                if not isinstance(v, torch.Tensor) or isinstance(v, FakeTensor):
                    continue
                if v.device.type != "cpu" or (self.pin and v.dim() > 0 and not v.is_pinned()):
                    host = (
                        self._host(v)
                        if v.dim() > 0
                        else host_made(torch.empty_like(v, device="cpu"))
                    )
                    st[k] = host.copy_(v)

    @property
    def on_host(self) -> dict[str, int]:
        """The optimizer state of every piece, and the masters and gradient buffers (copies
        of the device shards), in bytes; each storage counted once."""
        seen: set[int] = set()
        state = 0
        if self.optimizer is not None:
            for u in self.units:
                for *_, piece in u.pieces:
                    for v in self.optimizer.state.get(piece, {}).values():
                        if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor):
                            storage = v.untyped_storage()
                            if storage.data_ptr() not in seen:
                                seen.add(storage.data_ptr())
                                state += storage.nbytes()
        return {
            "optimizer_state": state,
            "master_parameters": sum(m.nbytes for m in self.masters.values()),
            "gradient_copies": sum(g.nbytes for g in self.grads.values()),
        }

    # -- checkpoints -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def reading(
        self, optimizer: torch.optim.Optimizer
    ) -> Iterator[Callable[[RankState], RankState]]:
        yield lambda state: state  # the pieces are the masters, current between steps

    @contextlib.contextmanager
    def loading(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        yield
        for u in self.units:
            assert u.shard is not None
            master = self.masters[u.index]
            if u.state is UnitState.SHARDED:  # stage 3 loaded into the pieces: the master
                u.shard.copy_(master)
            else:  # stages 1-2 loaded the full flat parameters, on the device
                master.copy_(u.shard)
            self._home_state(u, optimizer)

    def close(self) -> None:
        """The device shards are current (each step ends with its copies); the masters go."""
        if self.copies is not None:
            self.copies.drain()
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        self.masters.clear()
        self.grads.clear()


class ParamsOnHost(OnHost):
    """Parameter shards, gradients, masters and optimizer state in (pinned) host memory; on
    the device only the units in use ([Note: host parameter offload]). Also the engine's
    :class:`~longboat.grads.HeldGradients`."""

    grads_in_memory = False  # a reduction lands in a buffer of its own, copied out and dropped
    steps_by_unit = True
    hands_back_to: torch.device | None = torch.device("cpu")  # it may not fit beside the compute

    def __init__(self, ctx: StrategyContext, policy: ZeroPolicy) -> None:
        super().__init__(ctx, policy)
        self.has_grad: set[int] = set()  # units whose host gradient holds this step's sum
        self.squares: dict[int, torch.Tensor] = {}  # per unit: its gradient's sum of squares
        self.coef: torch.Tensor | None = None  # clipping, applied as each unit steps
        self.landing: dict[int, torch.cuda.Event | None] = {}  # a gradient's copy out
        self.arriving: dict[int, torch.cuda.Event | None] = {}  # a parameter shard's copy in

    def _copies(self, u: FlatUnit) -> Copies:
        """The copies' stream; the first gather may come before :meth:`start`."""
        if self.copies is None:
            self.copies = Copies(u.device)
        return self.copies

    def adopt(self, u: FlatUnit) -> None:
        super().adopt(u)  # the master made from the shard; the optimizer's pieces cut from it
        assert u.shard is not None
        free_storage(u.shard)
        if u.grad_shard is not None:
            free_storage(u.grad_shard)

    # -- parameters around their gathers ---------------------------------------------------------

    def bring_param(self, u: FlatUnit) -> None:
        assert u.shard is not None
        if not has_storage(u.shard):
            alloc_storage(u.shard)
            # A prefetch starts it before the current unit's compute is queued, so the copy
            # runs under that compute; the gather waits for it (param_ready).
            self.arriving[u.index] = self._copies(u).start_back(self.masters[u.index], u.shard)

    def param_ready(self, u: FlatUnit) -> None:
        if u.index in self.arriving:
            self._copies(u).arrived(self.arriving.pop(u.index), u.device)

    def drop_param(self, u: FlatUnit) -> None:
        assert u.shard is not None
        free_storage(u.shard)

    # -- gradients as they land ------------------------------------------------------------------

    def launched(self, units: list[FlatUnit], index: int) -> None:
        # Memory is what offload is for: at most offload_param.buffer_count reductions (each a
        # full-size gradient buffer and a shard) in flight, as [Note: parameter offload] bounds
        # them on disk.
        flying = [v for v in units[: index + 1] if v.reduced is not None]
        for v in flying[: max(len(flying) - self.cfg.offload_param.buffer_count, 0)]:
            self.land(v)

    def land(self, u: FlatUnit) -> None:
        reduced = wait_reduction(u)
        u.flat_grad = None
        copies, host = self._copies(u), self.grads[u.index]
        self._wait_landing(u.index)
        if u.index in self.has_grad:  # an earlier micro-batch of this step landed: add to it
            staged = self._host(reduced)
            copies.wait(copies.out(reduced, staged))
            host.add_(staged.to(host.dtype))
            self.squares[u.index] = torch.linalg.vector_norm(host, dtype=torch.float32).square()
        else:
            self.squares[u.index] = torch.linalg.vector_norm(reduced, dtype=torch.float32).square()
            self.landing[u.index] = copies.out(reduced, host)
            self.has_grad.add(u.index)
        del reduced  # its memory goes once the copy is over (the side stream recorded it)

    def _wait_landing(self, index: int) -> None:
        if index in self.landing and self.copies is not None:
            self.copies.wait(self.landing.pop(index))

    def local_gradients(self) -> list[torch.Tensor]:
        return []  # held: see gradient_squares

    def held_gradients(self) -> ParamsOnHost:
        return self

    def gradient_squares(self) -> torch.Tensor:
        """The sum of squares of every unit's gradient (after the step's last reduction)."""
        total = torch.zeros((), dtype=torch.float32)
        for sq in self.squares.values():
            total = total.to(sq.device) + sq
        return total

    def scale_gradients(self, coef: torch.Tensor) -> None:
        """Multiply every gradient by ``coef``, on the host as each unit steps."""
        self.coef = coef if self.coef is None else self.coef * coef

    # -- the step (a UnitHome of its own stream) -------------------------------------------------

    def bring(self, u: FlatUnit) -> None:
        return None  # the gradient went out as it landed

    def install(self, u: FlatUnit, optimizer: torch.optim.Optimizer, brought: Any) -> None:
        grad = self.grads[u.index]
        self._wait_landing(u.index)
        if u.index not in self.has_grad:  # not reduced this step (no backward ran)
            grad.zero_()
        elif self.coef is not None:
            grad.mul_(self.coef.to(device="cpu", dtype=grad.dtype))

    def stepped(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> None:
        assert u.shard is not None
        if has_storage(u.shard):  # gathered now (every unit held): the update goes there too
            self._copies(u).back(self.masters[u.index], u.shard)
        self._home_state(u, optimizer)

    def step_over(self) -> None:
        self.coef = None
        self.has_grad.clear()
        self.squares.clear()

    # -- checkpoints -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def loading(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        yield  # stage 3 loads into the pieces: the masters
        for u in self.units:
            assert u.shard is not None
            if u.state is not UnitState.SHARDED or has_storage(u.shard):
                self._copies(u).back(self.masters[u.index], u.shard)
            self._home_state(u, optimizer)
        if self.copies is not None:
            self.copies.drain()

    @property
    def on_host(self) -> dict[str, int]:
        """The optimizer state, and the parameters and gradients (their only copies), in
        bytes."""
        out = super().on_host
        return {
            "optimizer_state": out["optimizer_state"],
            "parameters": out["master_parameters"],
            "gradients": out["gradient_copies"],
        }


__all__ = ["AHEAD", "Copies", "OnHost", "ParamsOnHost"]
