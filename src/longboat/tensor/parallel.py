"""Applying a tensor-parallel plan to a model, and what the rest of longboat asks of it after.

Tensor parallelism comes after the pipeline has cut the model into stages and before the
data-parallel strategy ([Note: mesh] in ``mesh.py``): it divides the parameters of the layers
its plan names across the ``tp`` ranks (each keeps its part as the parameter's ``data``, the
``Parameter`` object and its name unchanged) and replaces those layers' forwards. The
data-parallel strategy then sees an ordinary model of smaller parameters, and runs over the
``dp`` axis as it always does; :class:`~longboat.tensor.strategy.TensorParallelStrategy` wraps it
to turn its checkpoint pieces, whole state and gradient norm back into the full model's.

Why not DTensor's ``parallelize_module``: longboat's strategies keep parameters in flat
buffers of plain tensors, which DTensor parameters would not fit; DTensor's collectives would
pass by longboat's doorway (its log, hang watchdog and desync check); its stock column style is
silently wrong for a fused q|k|v weight; and on CPU its attention has no sharding rule. The
layers' communication is six pairs of moves in one autograd function (``regions.py``) over the
``tp`` doorway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.config.sections import TensorParallelConfig
from longboat.pieces import Slices, canonical_names
from longboat.strategies.base import Strategy
from longboat.tensor import plans
from longboat.tensor.layout import LayoutError, Split
from longboat.tensor.styles import Placement


@dataclass(frozen=True)
class Divided:
    """A parameter tensor parallelism divided: how, and its full shape."""

    split: Split
    shape: tuple[int, ...]


class TensorParallel:
    """The plan applied to one model on one rank; with ``tp = 1`` it does nothing."""

    def __init__(self, cfg: TensorParallelConfig, comm: Comm, check_unused: bool = True) -> None:
        self.cfg = cfg
        self.comm = comm
        self.check_unused = check_unused
        #: parameter name (every name of a tied one) -> how it is divided
        self.divided: dict[str, Divided] = {}
        self._by_id: dict[int, Divided] = {}
        self._replicated: list[nn.Parameter] = []

    @property
    def active(self) -> bool:
        return self.comm.world_size > 1

    # -- applying the plan ---------------------------------------------------------------------

    def apply(self, model: nn.Module, device: torch.device | None = None) -> None:
        """Divide ``model``'s parameters and replace its layers' forwards (in place), after
        giving every ``tp`` rank ``tp`` rank 0's weights (through ``device``, the data plane's,
        where the model is elsewhere)."""
        if not self.active:
            return
        try:
            self._apply(model, device)
        except LayoutError as e:
            raise ConfigError(str(e)) from None

    def _apply(self, model: nn.Module, device: torch.device | None) -> None:
        plan = plans.resolve(self.cfg.plan, model, self.cfg.divide)
        self._same_start(model, device)
        names = canonical_names(model)
        at = Placement(
            self.comm, self.cfg.sequence_parallel, self.cfg.sequence_dim, self._shard(names)
        )
        used: set[str] = set()
        for name, module in model.named_modules():
            if getattr(module, "placeholder", False):
                continue  # a layer another pipeline stage holds (pipeline/layered.py)
            found = plan.style_for(name)
            if found is not None:
                used.add(found[0])
                found[1].apply(module, name, at)
        unused = [p for p, _ in plan.styles if p not in used]
        if unused and self.check_unused:
            raise LayoutError(
                f"tensor_parallel.plan ({plan.name}): {', '.join(map(repr, unused))} name no "
                f"module of this {type(model).__name__}; its modules include "
                f"{', '.join(n for n, _ in list(model.named_modules())[1:7])}, ..."
            )
        modules = dict(model.named_modules())
        for pattern, attr in plan.divide:
            self._each_attribute(modules, pattern, attr, change=True)
        for pattern, attr in plan.check:
            self._each_attribute(modules, pattern, attr, change=False)
        self._replicated = [
            p for p in dict.fromkeys(model.parameters()) if id(p) not in self._by_id
        ]
        all_names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            all_names.setdefault(id(p), []).append(n)
        for pid, d in self._by_id.items():
            for n in all_names.get(pid, []):
                self.divided[n] = d

    def _same_start(self, model: nn.Module, device: torch.device | None) -> None:
        """Every ``tp`` rank takes ``tp`` rank 0's parameters and buffers, as the data-parallel
        strategies give every ``dp`` rank its rank 0's: each rank then cuts its slices from the
        same full tensors, and the parameters kept whole are alike on the ``tp`` peers, as
        their gradients (never summed over ``tp``) and the gradient norm assume. Ranks that
        initialised differently (no seed) would otherwise train a mix of models, silently.
        Tensors still on the meta device are made later (ZeRO-3's deferred init)."""
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_meta:
                    continue
                # NCCL takes only tensors on the data plane's device; the engine moves the
                # model there only after dividing it, so that no rank holds it whole there.
                data = t.data
                staged = data if device is None else data.to(device)
                self.comm.broadcast(staged, src=0)
                if staged is not data:
                    data.copy_(staged)

    def _shard(self, names: dict[int, str]) -> Callable[[nn.Module, str, str, Split], None]:
        size, rank = self.comm.world_size, self.comm.rank

        def shard(module: nn.Module, module_name: str, attr: str, split: Split) -> None:
            p = getattr(module, attr)
            where = f"{module_name}.{attr}"
            done = self._by_id.get(id(p))
            if done is not None:  # a tied weight, reached through its second module
                if done.split != split:
                    raise LayoutError(
                        f"{where} is tied to {names.get(id(p), '?')}, and the plan divides the "
                        f"two differently ({done.split} vs {split}); give them styles that cut "
                        "the weight alike (rowwise embedding with colwise head), or untie them"
                    )
                return
            shape = tuple(p.shape)
            split.check(names.get(id(p), where), shape, size)
            with torch.no_grad():
                p.data = split.local(p.data, rank, size)
            self._by_id[id(p)] = Divided(split, shape)

        return shard

    def _each_attribute(
        self, modules: dict[str, nn.Module], pattern: str, attr: str, change: bool
    ) -> None:
        size = self.comm.world_size
        for name, module in modules.items():
            if not plans.matches(pattern, name) or getattr(module, "placeholder", False):
                continue  # (a placeholder: the part of a layer another pipeline stage holds)
            *path, last = attr.split(".")
            owner: object = module
            for step in path:
                owner = getattr(owner, step)
            value = getattr(owner, last, None)
            if not isinstance(value, int):
                raise LayoutError(
                    f"tensor_parallel: {name}.{attr} should be a whole number to divide among "
                    f"the ranks, not {value!r}"
                )
            if value % size:
                raise LayoutError(
                    f"tensor_parallel: {name}.{attr} = {value} does not divide among tp = "
                    f"{size} ranks; choose a tp that divides it"
                )
            if change:
                setattr(owner, last, value // size)

    # -- what the engine and the strategy wrapper ask ------------------------------------------

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every divided parameter's full shape, by name (for the model's fingerprint)."""
        return {n: d.shape for n, d in self.divided.items()}

    def slices(self, name: str) -> Slices | None:
        """The slices of parameter ``name``'s full tensor this rank holds (None: it is whole)."""
        d = self.divided.get(name)
        if d is None:
            return None
        return d.split.slices(d.shape, self.comm.rank, self.comm.world_size)

    def whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's part of ``name``) gathered into the full tensor; every ``tp``
        rank calls it for the same names in the same order."""
        d = self.divided[name]
        flat = local.detach().contiguous().view(-1)
        out = flat.new_empty(flat.numel() * self.comm.world_size)
        self.comm.all_gather(out, flat, tag=f"tp.whole.{name}")
        parts = [t.view(local.shape) for t in out.chunk(self.comm.world_size)]
        return d.split.whole(parts, d.shape)

    def counted_elsewhere(self, strategy: Strategy) -> list[torch.Tensor]:
        """Gradient shares another ``tp`` rank counts in the norm: those of parameters whole on
        every ``tp`` rank (their gradients are alike), on each ``tp`` rank but the first."""
        if not self.active or self.comm.rank == 0:
            return []
        shares = []
        for p in self._replicated:
            if p.requires_grad and (g := strategy.gradient_share(p)) is not None:
                shares.append(g)
        return shares
