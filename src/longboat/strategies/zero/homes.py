"""Where a rank's ZeRO units keep their state between uses: one home, built once from the config.

[Note: homes] A unit's optimizer state, parameter shard and gradient shard live in one home,
chosen from ``zero.offload_optimizer`` and ``zero.offload_param`` when the strategy is set up:

- :class:`InMemory` (``in_memory.py``): with the parameters (``device = "none"``, or ``"cpu"``
  where the compute device is the CPU: the state is there already, [Note: host copies on CPU] in
  ``host.py``);
- :class:`OnHost` (``host.py``): ``offload_optimizer.device = "cpu"`` beside an accelerator
  (ZeRO-Offload): master shards and optimizer state in pinned host memory, the optimizer
  stepping on the CPU, gradients copied out and masters copied back unit by unit ([Note: host
  offload]);
- :class:`OnDisk`: the optimizer state in swap files ([Note: optimizer state offload] in
  ``offload.py``), stage 3's parameter and gradient shards too with ``offload_param`` ([Note:
  parameter offload] in ``shard_swap.py``); units step one by one through a
  :class:`~longboat.strategies.zero.offload.UnitStream` that reads each ahead and writes it behind;
- :class:`ParamsOnHost` (``host.py``): ``offload_param.device = "cpu"`` with
  ``offload_optimizer.device = "cpu"`` beside an accelerator: stage 3's parameter and gradient
  shards in host memory too, on the device only while a unit is gathered ([Note: host parameter
  offload]).

The strategy asks a home the same questions whichever it is (:class:`Home`): how a reduction
joins the gradient shard, which gradients the optimizer sees, how units step, what a checkpoint
reads and writes, what is on disk. ``offload_param.device = "cpu"`` beside an accelerator
without ``offload_optimizer.device = "cpu"`` is refused by name ([Note: compositions]): the
parameter shard is what the optimizer steps, so it would have to come back to the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from longboat import cpu_pool, heap
from longboat.observe.memory import optimizer_state_bytes_per_param
from longboat.pieces import RankState
from longboat.placement import planning_for_accelerator
from longboat.strategies.base import StrategyContext
from longboat.strategies.zero.blocks import Blocks
from longboat.strategies.zero.cpu_step import prefer_cpu_kernels
from longboat.strategies.zero.flat import FlatUnit
from longboat.strategies.zero.home import Home, StepUnit
from longboat.strategies.zero.host import OnHost, ParamsOnHost
from longboat.strategies.zero.in_memory import InMemory, wait_reduction
from longboat.strategies.zero.offload import StateSwap, UnitHome, UnitStream, check_room
from longboat.strategies.zero.policy import ZeroPolicy
from longboat.strategies.zero.shard_swap import ShardSwap
from longboat.world import device_for


def build(
    ctx: StrategyContext,
    policy: ZeroPolicy,
    model: nn.Module,
    params: list[nn.Parameter],
    host_copies: bool = False,
) -> Home:
    """The home ``ctx.section`` asks for ([Note: homes]). ``host_copies``: build
    :class:`OnHost` (or :class:`ParamsOnHost`) for ``device = "cpu"`` on a CPU rank too, with
    real copies ([Note: host copies on CPU] in ``host.py``); not a config key. The planner's
    run for an accelerator builds them too ([Note: planning host offload] in ``placement.py``)."""
    cfg = ctx.section
    if "disk" in (cfg.offload_optimizer.device, cfg.offload_param.device):
        return OnDisk(ctx, policy, model, params)
    if cfg.offload_optimizer.device == "cpu" and (
        host_copies or planning_for_accelerator() or _on_accelerator(ctx, params)
    ):
        if cfg.offload_param.device == "cpu" and policy.shard_params:
            return ParamsOnHost(ctx, policy)
        return OnHost(ctx, policy)
    return InMemory(ctx, policy)


def _on_accelerator(ctx: StrategyContext, params: list[nn.Parameter]) -> bool:
    """Whether the units compute on an accelerator: where this rank computes, when the engine
    said so, else where the parameters are, or for a model on the meta device ([Note: deferred
    init] in ``init.py``) where the world says."""
    if ctx.device is not None:  # the parameters may still be where the user built them
        return ctx.device.type != "cpu"
    real = [p for p in params if not p.is_meta]
    device = real[0].device if real else device_for(ctx.world)
    return device.type != "cpu"


class OnDisk(InMemory):
    """The optimizer state on disk, and with ``offload_param`` stage 3's shards too ([Note:
    homes]); what stays in memory is handled as :class:`InMemory` does."""

    def __init__(
        self,
        ctx: StrategyContext,
        policy: ZeroPolicy,
        model: nn.Module,
        params: list[nn.Parameter],
    ) -> None:
        super().__init__(ctx, policy)
        # Buffers read from disk and freed a unit later go back to the system, so the budget
        # holds at glibc's defaults ([Note: fixed mmap threshold] in ``heap.py``).
        # Large temporaries are then reused from a pool of their own ([Note: warm blocks]).
        planning = any(isinstance(p, FakeTensor) for p in params)  # not in the planner's run
        if not planning and heap.fix_mmap_threshold():
            largest = max((p.numel() * p.element_size() for p in params), default=0)
            cpu_pool.install(2 * largest, heap.MMAP_THRESHOLD)
        self.rank = ctx.world.rank
        self.swap: StateSwap | None = None  # [Note: optimizer state offload]
        self.shards: ShardSwap | None = None  # [Note: parameter offload]
        self.stream: UnitStream | None = None  # steps units with their offloaded parts
        # What the home frees, the next unit's use takes again ([Note: reused blocks]): as many
        # blocks of each size wait as the home reads ahead.
        on_disk = [
            c for c in (self.cfg.offload_param, self.cfg.offload_optimizer) if c.device == "disk"
        ]
        self.blocks = Blocks(max([2] + [c.buffer_count for c in on_disk]))
        if self.cfg.offload_param.device == "disk":  # each unit's shards out once built
            dry = any(isinstance(p, FakeTensor) for p in params)
            self.shards = ShardSwap(self.cfg.offload_param, self.rank, dry, self.blocks)
        # On disk the gradient shard has no memory to land in, even on one rank.
        self.grads_in_memory = self.shards is None
        self.steps_by_unit = True

    def adopt(self, u: FlatUnit) -> None:
        super().adopt(u)
        if self.shards is not None:
            self.shards.adopt(u)

    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """The swap files of [Note: optimizer state offload], when the config asks for disk,
        and the stream that steps units through them."""
        super().start(optimizer)
        cfg = self.cfg.offload_optimizer
        if not self.units:
            return
        dry = any(isinstance(u.shard, FakeTensor) for u in self.units)
        parts: list[UnitHome] = []
        if cfg.device == "disk":
            self.swap = StateSwap(cfg, self.units, self.rank, self.blocks)
            if not dry:
                with contextlib.suppress(ValueError):  # an optimizer without a known formula
                    k = optimizer_state_bytes_per_param(optimizer)
                    check_room(self.swap.dir, k * sum(u.shard_numel for u in self.units))
            parts.append(self.swap)
            prefer_cpu_kernels(optimizer)  # units step on the CPU, their state read in for it
        ahead = cfg.buffer_count if cfg.device == "disk" else self.cfg.offload_param.buffer_count
        self.stream = UnitStream(parts, self.units, ahead, dry)
        if self.shards is not None:
            self.shards.submit = self.stream.submit
            parts.insert(0, self.shards)  # parameters and gradients before the state

    def bring_param(self, u: FlatUnit) -> None:
        if self.shards is not None:
            self.shards.bring_param(u)

    def drop_param(self, u: FlatUnit) -> None:
        if self.shards is not None:
            self.shards.drop_param(u)

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.shards is None or device.type != "cpu":  # only on disk are they recycled
            return super().buffer(numel, dtype, device)
        return self.blocks.take(numel, dtype)

    def launched(self, units: list[FlatUnit], index: int) -> None:
        if self.shards is None:
            return
        # [Note: parameter offload]: memory is what offload is for, so at most buffer_count
        # reductions (each a full-size gradient buffer and a shard) are in flight; without a
        # bound, a backward that outruns the wire holds every unit's.
        flying = [v for v in units[: index + 1] if v.reduced is not None]
        for v in flying[: max(len(flying) - self.shards.limit, 0)]:
            self.land(v)

    def land(self, u: FlatUnit) -> None:
        if self.shards is None:
            return super().land(u)
        self.shards.land(u, wait_reduction(u))  # [Note: parameter offload]: to the unit's file
        if u.flat_grad is not None:  # the reduction's full-size buffer, nobody's now
            self.blocks.recycle(u.flat_grad)
        u.flat_grad = None

    def grad_pieces(self, u: FlatUnit) -> list[torch.Tensor]:
        if self.shards is None:
            return super().grad_pieces(u)
        return self.shards.grad_pieces[u.index]

    def local_gradients(self) -> list[torch.Tensor]:
        return super().local_gradients() if self.shards is None else []  # see held_gradients

    def step(self, optimizer: torch.optim.Optimizer, step_unit: StepUnit) -> None:
        if self.stream is not None:
            self.stream.step(optimizer, step_unit)

    def step_over(self) -> None:
        if self.shards is None:
            return super().step_over()
        self.shards.step_over()  # the next step's first reduction overwrites each file

    @contextlib.contextmanager
    def reading(
        self, optimizer: torch.optim.Optimizer
    ) -> Iterator[Callable[[RankState], RankState]]:
        # The pieces copy what they hold; then out again.
        if self.shards is not None:
            self.shards.bring_all_params()
        if self.swap is not None:
            self.swap.bring_all(optimizer)
        try:
            yield self._own
        finally:
            if self.swap is not None:
                self.swap.drop_all(optimizer)
            if self.shards is not None:
                self.shards.drop_all_params()

    def _own(self, state: RankState) -> RankState:
        """``state`` with its pieces that are views of shards about to be dropped copied."""
        if self.shards is None:
            return state
        shards = {u.shard.untyped_storage().data_ptr() for u in self.units}  # type: ignore[union-attr]
        for pc in state.pieces:
            if pc.tensor.untyped_storage().data_ptr() in shards:
                pc.tensor = pc.tensor.clone()
        return state

    @contextlib.contextmanager
    def loading(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        if self.shards is not None:
            self.shards.bring_all_params()
        yield
        if self.swap is not None:
            self.swap.store_all(optimizer)
        if self.shards is not None:
            self.shards.store_all_params()

    def held_gradients(self) -> ShardSwap | None:
        """[Note: parameter offload]: the engine's clipping asks them for their sum of squares
        and hands them its factor."""
        return self.shards

    @property
    def on_disk(self) -> dict[str, int]:
        out = dict(self.shards.disk_bytes) if self.shards is not None else {}
        if self.swap is not None:
            out["optimizer_state"] = self.swap.disk_bytes
        return out

    @property
    def offloaded(self) -> dict[str, int] | None:
        if self.stream is None:
            return None
        parts = [h for h in (self.swap, self.shards) if h is not None]
        return {
            "disk": sum(self.on_disk.values()),
            "moved": sum(h.moved for h in parts),
            "read": sum(h.read_bytes for h in parts),
            "written": sum(h.written_bytes for h in parts),
        }

    def close(self) -> None:
        """After the strategy's last gathers, which read the shards' files."""
        if self.swap is not None:
            self.swap.close()
            self.swap = None
        if self.shards is not None:
            self.shards.close()
            self.shards = None
        if self.stream is not None:
            self.stream.close()
            self.stream = None
