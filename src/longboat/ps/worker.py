"""Parameter server: workers push gradients to server ranks and pull parameters back.

The servers and their modes are in ``longboat.ps`` ([Note: parameter server modes] in
``ps/server.py``, [Note: parameter server roles] in ``ps/service.py``); this file is the
workers' side of the engine's step. A key is one parameter group's trainable parameters of one
dtype, laid end to end and divided among the servers (``ps/layout.py``).

The step, with ``update_on_server`` (the default): backward leaves each worker's gradients in
``p.grad``, as in plain PyTorch; at the optimizer step the worker pushes them (with which
parameters it used, and its learning rate, so a scheduler on the workers drives the servers'
optimizers) and pulls the parameters the servers hold after applying them. The workers'
optimizer never steps; its state lives on the servers. Clipping (where the mode allows it) and
the fp16 overflow check see this worker's own gradients, before the push.

Without ``update_on_server`` (sync only) the servers only average: the worker pushes, pulls the
mean gradient into ``p.grad`` (None for a parameter no worker used) and steps its own
optimizer, exactly as ``replicate`` does after its all-reduce.

At the start every worker takes worker 0's parameters and buffers (a broadcast on the workers'
gloo group), and worker 0 gives the servers the initial values. In ``sync`` mode buffers are
broadcast from worker 0 after every training backward as under ``replicate`` ([Note: buffers]
in ``buffers.py``); in ``async`` and ``ssp`` each worker keeps its own (there is no collective
between workers) and checkpoints hold worker 0's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.pieces import PieceSource, RankState, members
from longboat.ps.client import Connection, uncaught_error
from longboat.strategies.base import StrategyContext, StrategyDefaults, full_gradient
from longboat.strategies.buffers import BufferSync
from longboat.strategies.whole_state import (
    WholeModel,
    load_whole_state,
    whole_model_state,
    whole_state,
)


class _Key:
    """One key's parameters, its group, and its flat buffers."""

    def __init__(self, group: int, params: list[nn.Parameter]) -> None:
        self.group = group
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.id = -1

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def grads(self) -> tuple[torch.Tensor, list[bool]]:
        used = [p.grad is not None for p in self.params]
        flat = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
                for p in self.params
            ]
        )
        return flat, used

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[a:b].view(p.shape)
            for p, a, b in zip(self.params, self.offsets, self.offsets[1:], strict=False)
        ]


class ParameterServer(WholeModel, StrategyDefaults):
    """Workers of a parameter-server job (``strategy = "parameter_server"``)."""

    name = "parameter_server"

    def __init__(self, ctx: StrategyContext) -> None:
        if ctx.service is None:
            raise ConfigError(
                "strategy 'parameter_server' needs its servers: create the engine with "
                "longboat.initialize, which starts them on the last "
                "parameter_server.servers ranks"
            )
        self.ctx = ctx
        self.cfg = ctx.section
        self.service = ctx.service
        self.sync = self.cfg.mode == "sync"
        self.comm = ctx.topology.data("dp")  # the workers in sync mode; this worker alone else
        self.worker = ctx.topology.coords["dp"]
        self.conn: Connection = self.service.connect(self.worker)
        self.keys: list[_Key] = []
        self.params: list[nn.Parameter] = []
        self._buffers: BufferSync | None = None
        self._exchanged = False
        # In async and ssp the workers share no collective: worker 0 writes checkpoints alone
        # (its parameters, buffers and the servers' state), the others skip the save.
        self.writes_checkpoints = self.sync or self.worker == 0

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        all_params = list(dict.fromkeys(model.parameters()))
        self.params = [p for p in all_params if p.requires_grad]
        self._broadcast_start(all_params, list(model.buffers()))
        trainable = {id(p) for p in self.params}
        for g, group in enumerate(optimizer.param_groups):
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in group["params"]:
                if id(p) in trainable:
                    by_dtype.setdefault(p.dtype, []).append(p)
            for ps in by_dtype.values():
                self.keys.append(_Key(g, ps))
        for k in self.keys:
            k.id = self.conn.declare([p.detach().cpu() for p in k.params], group=k.group)
        if self.cfg.update_on_server:
            self._pull_values()  # waits until worker 0's values reached every server
        if self.sync:
            self._buffers = BufferSync(model, self.comm)
        return model

    @torch.no_grad()
    def _broadcast_start(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """Every worker starts from worker 0's parameters and buffers (through the doorway over
        the workers' gloo group, so on the CPU, checked and logged as any collective)."""
        comm = self.service.setup_comm()
        if comm is None:
            return
        for t in [*params, *buffers]:
            cpu = t.data.cpu()
            comm.broadcast(cpu, src=0)  # worker 0 is group rank 0 of the workers' group
            t.data.copy_(cpu)

    @torch.no_grad()
    def _pull_values(self) -> None:
        for k in self.keys:
            flat = torch.empty(k.numel, dtype=k.params[0].dtype)
            self.conn.pull(k.id, flat)
            for p, v in zip(k.params, k.views(flat), strict=True):
                p.data.copy_(v)

    # -- the step ------------------------------------------------------------------------------

    def before_forward(self) -> None:
        pass

    def before_backward(self, sync: bool) -> None:
        pass

    def after_backward(self) -> None:
        if self._buffers is not None:
            self._buffers.after_backward()

    def finish_gradients(self) -> None:
        pass

    def wait_gradients(self) -> None:
        if not self.cfg.update_on_server and not self._exchanged:
            self._exchange_gradients()

    def _push(self, with_lr: bool, optimizer: torch.optim.Optimizer | None = None) -> None:
        for k in self.keys:
            flat, used = k.grads()
            lr = None
            if with_lr and optimizer is not None:
                lr = float(optimizer.param_groups[k.group]["lr"])
            self.conn.push(k.id, flat, used, lr)

    @torch.no_grad()
    def _exchange_gradients(self) -> None:
        """Without update_on_server: push, then pull the mean gradients into ``p.grad``."""
        self._push(with_lr=False)
        for k in self.keys:
            flat = torch.empty(k.numel, dtype=k.params[0].dtype)
            used = self.conn.pull(k.id, flat)
            for p, g, u in zip(k.params, k.views(flat), used, strict=True):
                p.grad = g.to(p.device) if u else None
        self._exchanged = True

    def hooked_modules(self) -> list[nn.Module]:
        return []  # no forward hooks

    def norm_groups(self) -> list[Comm]:
        return []  # each worker's gradients are whole: the local norm is the norm

    def local_gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def tied_gradient(self, param: nn.Parameter) -> torch.Tensor:
        return full_gradient(param)

    def gradient_share(self, param: nn.Parameter) -> torch.Tensor | None:
        return param.grad

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.cfg.update_on_server:
            if not self._exchanged:
                self._exchange_gradients()
            optimizer.step()
            self._exchanged = False
            return
        self._push(with_lr=True, optimizer=optimizer)
        self._pull_values()
        # The servers stepped: tell torch's LR schedulers the optimizer did too.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    # -- what the engine reports ---------------------------------------------------------------

    @property
    def staleness(self) -> dict[str, int]:
        """From the last pull: this worker's staleness (clocks it ran ahead of what the
        servers applied), the most it has seen, the slowest live worker's clock and how many
        workers the servers dropped."""
        c = self.conn
        return {
            "staleness": c.staleness,
            "max_staleness": c.max_staleness,
            "slowest_clock": c.min_clock,
            "dropped_workers": c.dropped,
        }

    @property
    def monitor_columns(self) -> list[str]:
        """The monitor's columns: each worker's staleness."""
        return [f"staleness_w{i}" for i in range(len(self.service.workers))]

    def monitor_values(self) -> dict[str, float]:
        """Each worker's staleness as the first server counts it: how many clocks it is
        behind the furthest worker (one small request, at the monitor's events)."""
        clocks = self.conn.clocks()
        top = max(clocks)
        return {f"staleness_w{i}": float(top - c) for i, c in enumerate(clocks)}

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        """[Note: memory formulas] for a worker of ``a`` fp32 parameters and an optimizer of
        ``k`` bytes per parameter: the whole model and its gradients; the optimizer state only
        where the worker steps (without ``update_on_server``)."""
        return whole_model_state(a, k, optimizer_here=not self.cfg.update_on_server)

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        # Workers hold the whole model alike (sync), or worker 0's counts (async, ssp: each
        # worker writes alone, see [Note: parameter server roles]); the servers' optimizer
        # state is fetched into the worker's optimizer for the time of the snapshot.
        if not self.cfg.update_on_server:
            return whole_state(model, optimizer, members(self.comm))
        self._fetch_server_state(optimizer)
        try:
            return whole_state(model, optimizer, members(self.comm))
        finally:
            for k in self.keys:
                for p in k.params:
                    optimizer.state.pop(p, None)

    @torch.no_grad()
    def _fetch_server_state(self, optimizer: torch.optim.Optimizer) -> None:
        for k in self.keys:
            values = torch.empty(k.numel, dtype=k.params[0].dtype)
            state: dict[int, dict[str, Any]] = {}
            tensors: dict[int, set[str]] = {}  # per parameter: its state's tensor entries
            for meta, flat in self.conn.state(k.id):
                segs = meta["segments"]
                span = sum(s["end"] - s["start"] for s in segs)
                offset = 0
                for s in segs:
                    n = s["end"] - s["start"]
                    values[s["start"] : s["end"]].copy_(flat[offset : offset + n])
                    offset += n
                offset = span
                for s in segs:
                    i, n = s["index"], s["end"] - s["start"]
                    p = k.params[i]
                    st = state.setdefault(i, {})
                    names = tensors.setdefault(i, set())
                    at = s["start"] - k.offsets[i]
                    for name, spec in s["state"].items():
                        if "numel" in spec:
                            full = st.setdefault(
                                name,
                                torch.zeros(p.numel(), dtype=getattr(torch, spec["dtype"])),
                            )
                            full[at : at + n].copy_(flat[offset : offset + n])
                            names.add(name)
                            offset += n
                        elif "scalar" in spec:
                            dtype = getattr(torch, spec["dtype"])
                            st[name] = torch.tensor(spec["scalar"], dtype=dtype)
                        else:
                            st[name] = spec["value"]
            for p, v in zip(k.params, k.views(values), strict=True):
                p.data.copy_(v)  # the servers' values, which the optimizer state goes with
            for i, st in state.items():
                p = k.params[i]
                optimizer.state[p] = {
                    n: t.view(p.shape).to(p.device) if n in tensors[i] else t for n, t in st.items()
                }

    @torch.no_grad()
    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
    ) -> None:
        load_whole_state(model, optimizer, source)
        if self.worker == 0:  # every worker read the same: worker 0 tells the servers
            self._give_servers_state(optimizer if self.cfg.update_on_server else None)
        if self.cfg.update_on_server:  # the servers' optimizers hold it from here on
            for k in self.keys:
                for p in k.params:
                    optimizer.state.pop(p, None)
        for k in self.keys:
            self.conn.clock[k.id] = 0
        self.conn.barrier()  # no worker pushes before every server has the loaded state

    def _give_servers_state(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Send each server its ranges of the loaded values and (``optimizer``) optimizer
        state; every clock starts again at 0."""
        for k in self.keys:
            lay = self.conn.layouts[k.id]
            dtype = k.params[0].dtype
            flat_values = torch.cat([p.detach().reshape(-1).cpu() for p in k.params])
            per_server = []
            for s in lay.holders():
                tensors = [flat_values[lay.ranges[s][0] : lay.ranges[s][1]]]
                segs = []
                for seg in lay.segments(s):
                    p = k.params[seg.index]
                    at, n = seg.start - k.offsets[seg.index], seg.numel
                    st: dict[str, Any] = {}
                    held = optimizer.state.get(p, {}) if optimizer is not None else {}
                    for name, x in held.items():
                        if isinstance(x, torch.Tensor) and x.dim() > 0:
                            st[name] = {"numel": n, "dtype": str(x.dtype).removeprefix("torch.")}
                            tensors.append(x.detach().reshape(-1)[at : at + n].cpu().to(dtype))
                        elif isinstance(x, torch.Tensor):
                            st[name] = {
                                "scalar": x.item(),
                                "dtype": str(x.dtype).removeprefix("torch."),
                            }
                        else:
                            st[name] = {"value": x}
                    segs.append(
                        {"index": seg.index, "start": seg.start, "end": seg.end, "state": st}
                    )
                meta = {
                    "version": 0,
                    "clocks": [0] * len(self.service.workers),
                    "segments": segs,
                }
                per_server.append((meta, torch.cat(tensors)))
            self.conn.set_state(k.id, per_server)

    def close(self) -> None:
        if self._buffers is not None:
            self._buffers.close()
            self._buffers = None
        self.conn.close(uncaught_error())
        if self.conn.commlog is not None and self.worker == 0:  # comm.log: worker 0's view
            print(self.conn.commlog.table("parameter servers"), end="", flush=True)
        self.service.close()

    def discard(self) -> None:
        # The engine refused before setup: no goodbye (the servers may have refused too, and
        # would never answer it), but no heartbeats either.
        self.conn.abandon()

    def leave(self) -> None:
        # The servers' shutdown is this job's own protocol, not a collective of the groups,
        # and a worker that never closes must still stop them.
        self.close()
