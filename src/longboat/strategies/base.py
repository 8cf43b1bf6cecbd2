"""The small protocol every strategy implements.

The engine drives the step; a strategy decides where parameters, gradients and optimizer state
live and when they move. Nothing in the engine branches on a strategy's name, nor asks whether a
strategy has a member: what a strategy supports beyond the step is declared in the protocol, and
:class:`StrategyDefaults` gives what a strategy that supports none of it declares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.config.sections import Config
from longboat.grads import HeldGradients
from longboat.pieces import PieceSource, RankState
from longboat.precision import DTYPES
from longboat.topology import Topology
from longboat.world import World, device_for


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy may use: who we are, the mesh's doorways, its own config section, and
    the dtype gradients travel in (``precision.reduce_dtype`` or ``communication_data_type``;
    None: their own)."""

    world: World
    topology: Topology
    section: Any  # the strategy's own config section (e.g. ReplicateConfig), or None
    wire_dtype: torch.dtype | None = None
    #: ids of parameters tied across pipeline stages ([Note: tied weights] in ``pipeline/tied.py``):
    #: a sharding strategy gives each a flat unit of its own, laid out alike on every holder
    isolated: frozenset[int] = frozenset()
    #: ranks beside the mesh that serve this strategy (``longboat.ps.service``), or None
    service: Any = None
    #: the ``compression`` section: how the data-parallel reduction is compressed
    #: (``longboat.comm.compression``), or None
    compression: Any = None
    #: ``param_init_fn(module)`` given to ``longboat.initialize``: what initialises a module
    #: made from the meta device ([Note: deferred init] in ``zero/init.py``), or None
    param_init_fn: Callable[[nn.Module], object] | None = None
    #: ``precision.param_dtype``: the dtype ZeRO-3 gathers and computes parameters in, when it
    #: is not their own ([Note: parameter dtype] in ``zero/gather.py``), or None
    param_dtype: torch.dtype | None = None
    #: where this rank computes (the planner's run: the CPU it traces on); None: the world's
    device: torch.device | None = None

    @property
    def compute_device(self) -> torch.device:
        """Where this rank computes."""
        return self.device if self.device is not None else device_for(self.world)

    @classmethod
    def of(
        cls,
        world: World,
        topology: Topology,
        config: Config,
        section: str | None = None,
        isolated: frozenset[int] = frozenset(),
        service: Any = None,
        param_init_fn: Callable[[nn.Module], object] | None = None,
        device: torch.device | None = None,
    ) -> StrategyContext:
        wire = config.precision.wire_dtype()
        param = config.precision.param_dtype
        return cls(
            world,
            topology,
            getattr(config, section) if section else None,
            DTYPES[wire] if wire else None,
            isolated,
            service,
            config.compression,
            param_init_fn,
            DTYPES[param] if param not in (None, "fp32") else None,
            device,
        )


def full_gradient(param: nn.Parameter) -> torch.Tensor:
    """``param.grad``, made zeros if this rank's backward did not reach it (its copy on another
    pipeline stage may have a gradient to share: [Note: tied weights] in ``pipeline/tied.py``)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


class Strategy(Protocol):
    """How state is placed and synchronised; one implementation per file."""

    name: str

    # -- what it supports (the defaults: StrategyDefaults) -------------------------------------

    @property
    def can_shadow(self) -> bool:
        """Whether :meth:`shadow` can stand in for a micro-batch this rank has no batch for
        (``data.remainder = 'join'``, [Note: joining] in ``join.py``)."""
        ...

    @property
    def deferred_init(self) -> bool:
        """Whether a model whose parameters are on the meta device can be made here
        ([Note: deferred init] in ``zero/init.py``)."""
        ...

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this rank takes part in saving checkpoints (False: another rank writes what
        this one holds, as a parameter server's worker 0 does for the others in async mode)."""
        ...

    @property
    def monitor_columns(self) -> Sequence[str]:
        """The monitor's columns this strategy reports besides the engine's."""
        ...

    def monitor_values(self) -> dict[str, float]:
        """The values of :attr:`monitor_columns`, asked for at the monitor's events."""
        ...

    def held_gradients(self) -> HeldGradients | None:
        """Gradients kept out of memory ([Note: parameter offload] in ``zero/shard_swap.py``),
        which clipping asks for their sum of squares; None when every gradient is in memory."""
        ...

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        """Model-state bytes per category for ``a`` trainable parameters and an optimizer of
        ``k`` bytes per parameter: this strategy's row of [Note: memory formulas]
        (``observe/memory.py``), what the memory report sets beside what it measures."""
        ...

    @property
    def on_disk(self) -> dict[str, int]:
        """Bytes of model state this rank keeps on disk, per category."""
        ...

    @property
    def on_host(self) -> dict[str, int]:
        """Bytes of model state this rank keeps in host memory beside an accelerator, by kind
        (a category held there instead of on the device, or a host copy)."""
        ...

    @property
    def offloaded(self) -> dict[str, int] | None:
        """With state offloaded to disk: bytes on disk (``disk``) and read and written so far
        (``moved``); None without."""
        ...

    # -- the step ------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Prepare the model (sync initial state, install hooks); return the module to call."""
        ...

    def before_forward(self) -> None:
        """Called before each forward."""
        ...

    def before_backward(self, sync: bool) -> None:
        """Called before each backward; ``sync`` is True on the accumulation boundary."""
        ...

    def after_backward(self) -> None:
        """Called after each backward has returned (saved tensors are released by then)."""
        ...

    def shadow(self) -> None:
        """Between ``before_backward`` and ``after_backward`` on a rank without a batch for
        this micro-batch ([Note: joining] in ``join.py``): issue what the others' forward and
        backward issue, contributing nothing. With ``after_backward`` (which launches what a
        backward left, with zeros) and the step, this rank stays in step with the others.
        Called only where :attr:`can_shadow`."""
        ...

    def buffers_from(self, rank: int) -> None:
        """Whose buffers every rank takes after the following micro-batches: data-parallel rank
        ``rank`` (0, as DDP; while ranks have joined, the lowest one with a batch)."""
        ...

    def finish_gradients(self) -> None:
        """After the boundary backward: start whatever communication is still outstanding."""
        ...

    def wait_gradients(self) -> None:
        """Block until each trainable ``p.grad`` holds the gradient averaged over ranks.

        ``optimizer_step`` waits by itself (possibly piece by piece, overlapping the optimizer
        with communication); the engine calls this first only when it must see every gradient
        (clipping, overflow checks).
        """
        ...

    def hooked_modules(self) -> list[nn.Module]:
        """The modules whose forward this strategy's hooks wrap (ZeRO-3's units), which
        compiling keeps out of its graphs ([Note: compiling under a strategy] in
        ``longboat/compile.py``); none for a strategy that hooks no forward."""
        ...

    def norm_groups(self) -> list[Comm]:
        """The doorways over which ``local_gradients`` are disjoint pieces of the model's
        gradients: the squares of their norms are summed over each. Empty when every rank of
        the data-parallel axis holds the same full gradients."""
        ...

    def local_gradients(self) -> list[torch.Tensor]:
        """After :meth:`wait_gradients`: the averaged gradients this rank owns, each once.

        The engine unscales, checks and clips these in place.
        """
        ...

    def tied_gradient(self, param: nn.Parameter) -> torch.Tensor:
        """After :meth:`wait_gradients`: the tensor holding this rank's reduced gradient of
        ``param`` (a parameter of ``StrategyContext.isolated``), to be summed in place with its
        copies on other pipeline stages ([Note: tied weights] in ``pipeline/tied.py``)."""
        ...

    def gradient_share(self, param: nn.Parameter) -> torch.Tensor | None:
        """After :meth:`wait_gradients`: this rank's share of ``param``'s reduced gradient, a
        view into (or one of) :meth:`local_gradients`; None if this rank holds none of it."""
        ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the optimizer to the (synchronised) gradients."""
        ...

    def memory_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps, by category (see ``longboat.observe.memory``)."""
        ...

    def gathered_parameters(self) -> AbstractContextManager[None]:
        """A context (entered and left by every rank) inside which every parameter is whole on
        every rank, so that one rank may run forwards alone (evaluation under no_grad). A no-op
        for strategies that hold parameters whole."""
        ...

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` with every tensor whole, on every rank."""
        ...

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> RankState:
        """This rank's parameters, buffers and optimizer state as pieces of the full tensors
        (see [Note: pieces] in ``pieces.py``). Called between steps."""
        ...

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, source: PieceSource
    ) -> None:
        """Fill this rank's share of model and optimizer state from ``source``, whatever
        strategy and world size wrote it. Called between steps."""
        ...

    def close(self) -> None:
        """Remove hooks and free buffers; may hand the user back an ordinary model, which can
        take collectives (every rank closes together)."""
        ...

    def leave(self) -> None:
        """At exit, for an engine the script never closed: release what :meth:`close` releases
        (hooks, buffers, files), with no collective, since by then the ranks may hold different
        engines ([Note: leaving at exit] in ``engine/core.py``)."""
        ...

    @property
    def places_parameters(self) -> bool:
        """Whether the strategy brings the model's trainable parameters to the device itself,
        a unit at a time, from where the user built them (ZeRO-3 with its parameters in host
        memory: [Note: placing parameters] in ``zero/init.py``); the engine then leaves them
        there."""
        ...

    def discard(self) -> None:
        """The engine failed before this strategy was set up (a refusal, an error in setup):
        stop what building it started (threads, connections) without a word to any peer, which
        may have failed as well."""
        ...


def cannot_shadow(name: str) -> ConfigError:
    """The refusal of ``data.remainder = 'join'`` by strategy ``name``, which cannot shadow."""
    return ConfigError(
        f"data.remainder = 'join' with strategy {name!r}: it cannot take part in the others' "
        "collectives without a batch; use data.remainder = 'pad' or 'drop'"
    )


class StrategyDefaults:
    """What a strategy supports unless it says otherwise (the protocol's first members): no
    joining, no meta-device model, checkpoints written by every rank, nothing for the monitor,
    every gradient in memory, the formulas' table for its memory, nothing on disk.

    A strategy inherits these and overrides what it supports.
    """

    name: str
    # An attribute, not a property: a strategy may decide it per rank, at construction.
    writes_checkpoints: bool = True

    @property
    def can_shadow(self) -> bool:
        return False

    @property
    def deferred_init(self) -> bool:
        return False

    @property
    def monitor_columns(self) -> Sequence[str]:
        return ()

    def monitor_values(self) -> dict[str, float]:
        return {}

    def held_gradients(self) -> HeldGradients | None:
        return None

    @property
    def on_disk(self) -> dict[str, int]:
        return {}

    @property
    def on_host(self) -> dict[str, int]:
        return {}

    @property
    def offloaded(self) -> dict[str, int] | None:
        return None

    def shadow(self) -> None:
        raise cannot_shadow(self.name)

    def discard(self) -> None:
        pass  # building it started nothing that outlives it

    @property
    def places_parameters(self) -> bool:
        return False

    def buffers_from(self, rank: int) -> None:
        pass  # it cannot shadow, so every rank has a batch and rank 0's buffers count
