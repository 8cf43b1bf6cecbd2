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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from longboat.pieces import RankState
from longboat.strategies.zero.flat import FlatUnit, UnitState
from longboat.strategies.zero.in_memory import InMemory
from longboat.strategies.zero.offload import UnitStream
from longboat.strategies.zero.policy import ZeroPolicy

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
        if self.side is None:
            dst.copy_(src)
            return
        compute = torch.cuda.current_stream(dst.device)
        self.side.wait_stream(compute)  # nothing on the device still reads the old dst
        with torch.cuda.stream(self.side):
            dst.copy_(src, non_blocking=True)
            dst.record_stream(self.side)
        compute.wait_stream(self.side)

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
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)

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
        for group in optimizer.param_groups:
            # The CPU's multi-tensor kernels, where the user chose neither way (torch picks
            # them by default on CUDA only); the same arithmetic, per element.
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True

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
                    host = self._host(v) if v.dim() > 0 else torch.empty_like(v, device="cpu")
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


__all__ = ["AHEAD", "Copies", "OnHost"]
