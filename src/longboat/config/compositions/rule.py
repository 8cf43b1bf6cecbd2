"""The shape of the table of compositions (:mod:`longboat.config.compositions`): a
:class:`Rule`, the :class:`Facts` beside the config that some rules read, and what the
rules read of a config."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from longboat.config.sections import SELF_REDUCING_OPTIMIZERS, Config


@dataclass(frozen=True)
class Facts:
    """What the caller knows beside the config when it builds a strategy: ``None`` where it
    does not know (a server rank has no model), and a rule that needs an unknown fact is not
    checked."""

    strategy: str | None = None  # the strategy in use (``auto`` resolved)
    device: str | None = None  # the device type training runs on ('cpu', 'cuda', ...)
    meta: bool | None = None  # some of the model's parameters are on the meta device
    deferred_init: bool | None = None  # the strategy makes parameters left on the meta device
    optimizer: str | None = None  # the optimizer's class name
    elementwise: bool | None = None  # its update of an element reads only that element
    not_elementwise_why: str = ""  # why not, in its class's own words where it gives them
    elementwise_ones: str = ""  # the optimizers that are, for the message
    reduces_itself: bool | None = None  # it all-reduces its own state ([Note: self-reducing...])
    step_hooks: bool | None = None  # step hooks are registered on it (or globally)


Moment = Literal["config", "build"]
Kind = Literal["by nature", "not built yet"]


@dataclass(frozen=True)
class Rule:
    """One composition longboat refuses: ``setting`` with ``other``."""

    name: str  # a stable id, for tests and links
    setting: str  # the first side, as the docs show it
    other: str  # the second side
    kind: Kind
    moment: Moment
    applies: Callable[[Config, Facts], bool]
    message: Callable[[Config, Facts], str]  # the whole refusal, with the values given
    example: Mapping[str, Any]  # a config the rule refuses
    example_facts: Facts = Facts()


def axes(c: Config) -> list[tuple[str, int]]:
    """The mesh axes beside plain ZeRO-3 that are more than one rank wide."""
    sizes = (("pp", c.mesh.pp), ("tp", c.mesh.tp), ("dp_replicate", c.mesh.dp_replicate or 1))
    return [(axis, size) for axis, size in sizes if size > 1]


def on_disk(c: Config) -> bool:
    return "disk" in (c.zero.offload_optimizer.device, c.zero.offload_param.device)


def disk_key(c: Config) -> str:
    return "offload_optimizer" if c.zero.offload_optimizer.device == "disk" else "offload_param"


def strategy_of(c: Config, f: Facts) -> str:
    return f.strategy or c.strategy


def zero(c: Config, f: Facts) -> bool:
    return strategy_of(c, f) == "zero"


def reducer(c: Config, f: Facts) -> str | None:
    """The name of an optimizer that reduces itself, from the config or the object."""
    if c.optimizer is not None and c.optimizer.type in SELF_REDUCING_OPTIMIZERS:
        return c.optimizer.type
    return f.optimizer if f.reduces_itself else None


def named(c: Config, f: Facts) -> str:
    """The optimizer that reduces itself as the user gave it: by its config key, or its class."""
    if c.optimizer is not None and c.optimizer.type in SELF_REDUCING_OPTIMIZERS:
        return f"optimizer.type = {c.optimizer.type!r}"
    return f"optimizer {f.optimizer}"


def compressing(c: Config, f: Facts) -> bool:
    return c.compression.method != "none"


def join_with(why: Callable[[Config], str]) -> Callable[[Config, Facts], str]:
    def message(c: Config, f: Facts) -> str:
        return (
            f"data.remainder = 'join' with {why(c)}; use data.remainder = 'pad' (every rank "
            "gets as many batches) or 'drop'"
        )

    return message


def compression_with(why: Callable[[Config], str]) -> Callable[[Config, Facts], str]:
    def message(c: Config, f: Facts) -> str:
        return f"compression.method = {c.compression.method!r} with {why(c)}"

    return message


COMPRESSED = {"compression": {"method": "powersgd"}}
DISK_PARAMS = {
    "strategy": "zero",
    "zero": {"stage": 3, "offload_param": {"device": "disk", "path": "/tmp/swap"}},
}
DISK_STATE = {
    "strategy": "zero",
    "zero": {"stage": 2, "offload_optimizer": {"device": "disk", "path": "/tmp/swap"}},
}


def low_params(c: Config) -> bool:
    """Parameters are to be gathered and computed in a lower precision than their own."""
    return c.precision.param_dtype not in (None, "fp32")


def offloads(c: Config) -> bool:
    """Some of ZeRO's state is offloaded (to CPU memory or disk)."""
    return any(d != "none" for d in (c.zero.offload_optimizer.device, c.zero.offload_param.device))


def stage_named(c: Config, f: Facts) -> str:
    """The strategy as a refusal names it: ``strategy = 'zero' with zero.stage = 2``, ..."""
    s = strategy_of(c, f)
    return (
        f"strategy = 'zero' with zero.stage = {c.zero.stage}"
        if s == "zero"
        else f"strategy = {s!r}"
    )


def wire_key(c: Config) -> str:
    """The key that set the dtype gradients travel in."""
    return "reduce_dtype" if c.precision.reduce_dtype else "communication_data_type"
