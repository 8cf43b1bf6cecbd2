"""DeepSpeed's ``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` on longboat's
ZeRO-3 ([Note: DeepSpeed call sites] in ``deepspeed/__init__.py``).

[Note: DeepSpeed zero contexts] ``with deepspeed.zero.Init(): model = Net()`` builds the model
without allocating its parameters, as DeepSpeed's does; here they are built on the meta device
and ZeRO-3 makes them, unit by unit, in ``deepspeed.initialize`` ([Note: deferred init] in
``longboat/strategies/zero/init.py``), so the config must be ZeRO-3 (given to ``Init``, a
config whose stage is not 3 is refused there; otherwise ``initialize`` refuses meta parameters
under another strategy). Unlike DeepSpeed's, every tensor made inside the block is on the meta
device, not only modules' parameters. ``Init``'s arguments that place or cast parameters
(``remote_device``, ``dtype``, ``mpu``, a ``data_parallel_group``) are refused by name: those are
the config's ``zero.offload_param``, ``precision`` and ``mesh`` here.

``with deepspeed.zero.GatheredParameters(params, modifier_rank=None):`` makes ``params`` whole
on every rank inside (every rank enters it: entering and leaving are collective, as in
DeepSpeed). DeepSpeed's call names parameters, not an engine: the engine whose model holds them
is found among the live ``deepspeed.initialize`` engines. Parameters no live ZeRO-3 engine
shards are whole already and the block does nothing, as DeepSpeed does for parameters it did
not partition. With ``modifier_rank=r``, what rank ``r`` wrote into the parameters inside is
broadcast to every rank and kept (each rank stores its shard again) on leaving; without it the
block is read-only, as DeepSpeed's is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longboat.config.errors import ConfigError
from longboat.config.loading import load
from longboat.deepspeed.engine import DeepSpeedEngine, live_engines


class Init:
    """DeepSpeed's ``deepspeed.zero.Init``: modules built inside take no memory until
    ``deepspeed.initialize`` shards them under ZeRO-3 (see [Note: DeepSpeed zero contexts])."""

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: dict[str, Any] | str | Path | None = None,
        config: dict[str, Any] | str | Path | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        **others: Any,
    ) -> None:
        del module, mem_efficient_linear, pin_memory  # a built module is sharded by initialize
        refused = {
            "remote_device": (remote_device not in (None, "none"), "zero.offload_param.device"),
            "dtype": (dtype not in (None, torch.float32), "the config's bf16/fp16 block"),
            "mpu": (mpu is not None, "the config's mesh section"),
            "data_parallel_group": (data_parallel_group is not None, "the config's mesh"),
        }
        refused.update({k: (v not in (None, False), "nothing here") for k, v in others.items()})
        for name, (given, instead) in refused.items():
            if given:
                raise ConfigError(
                    f"deepspeed.zero.Init({name}=...) is not supported: longboat takes it from "
                    f"{instead}; leave it out"
                )
        self.enabled = enabled
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        if enabled and cfg is not None:
            loaded = load(cfg)
            stage = loaded.config.zero.stage if loaded.config.strategy == "zero" else 0
            if stage != 3:
                raise ConfigError(
                    f"deepspeed.zero.Init(config_dict_or_path=...): the config's ZeRO stage is "
                    f"{stage}; a model built under Init is made by ZeRO-3 only. Set "
                    "zero_optimization.stage to 3, or build the model outside Init"
                )
        self._device: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()

    def __enter__(self) -> Init:
        if self.enabled:
            self._device = torch.device("meta")
        self._device.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._device.__exit__(kind, exc, tb)


class GatheredParameters:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters(params, modifier_rank=None,
    fwd_module=None, enabled=True)`` (see [Note: DeepSpeed zero contexts])."""

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        del fwd_module  # DeepSpeed's hook registration for external parameters; none here
        wanted = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.engine: DeepSpeedEngine | None = None
        if enabled and wanted:
            self.engine = _engine_sharding({id(p) for p in wanted})
        self._held: contextlib.AbstractContextManager[None] = contextlib.nullcontext()

    def __enter__(self) -> None:
        if self.engine is not None:
            self._held = self.engine.engine.gathered_parameters()
        self._held.__enter__()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.engine is None or self.modifier_rank is None or kind is not None:
            self._held.__exit__(kind, exc, tb)
            return
        # rank modifier_rank's values, whole, to every rank; then each stores its shard again
        state = {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}
        if dist.is_initialized():
            for tensor in state.values():
                dist.broadcast(tensor, self.modifier_rank)
        self._held.__exit__(None, None, None)
        self.engine.engine.load_state_dict(state)


def _engine_sharding(ids: set[int]) -> DeepSpeedEngine | None:
    """The live engine whose model holds the parameters ``ids`` under ZeRO-3, if any."""
    for engine in live_engines():
        if engine.zero_optimization_stage() != 3:
            continue
        if ids & {id(p) for p in engine.module.parameters()}:
            return engine
    return None


__all__ = ["GatheredParameters", "Init"]
