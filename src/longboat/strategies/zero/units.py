"""Which parameters form each flat unit of the ZeRO strategy.

Stages 1 and 2 cut the parameters into buckets of about ``zero.bucket_mb`` in reverse
registration order (as :mod:`longboat.comm.buckets` does), so gradient reductions start while
backward still runs. Stage 3 cuts along module boundaries: a unit is a module whose forward
gathers its parameters; the root module's unit holds everything no smaller unit claims.

[Note: units run forward] A stage-3 unit's parameters are gathered by hooks on its module's
forward, so a unit must be a module whose forward is called. Containers (``nn.ModuleList``,
``nn.ModuleDict``) have no forward: their parent calls the children, so a container made a unit
would never be gathered (transformers' GPT-2 keeps its blocks in ``transformer.h``, a
``ModuleList``). The policy therefore never chooses a container and, like FSDP's size-based
policy, counts its parameters towards the unit around it; a ``Sequential`` whose children are
units has nothing left to hold and is not one either. By default the units are the repeated
blocks a model declares (transformers' ``_no_split_modules``, as Accelerate uses them), else
modules by size. A chosen module whose forward did not run in the first training forward (its
parameters read directly by another module, say) is named in an error at that forward
(``gather.py``), rather than failing deep in torch on a parameter of shape [0].

[Note: shared parameters] A parameter used by modules of two different units (tied weights) is
given to the root unit, which stays gathered for the whole forward and backward, so every user of
the parameter sees its full value.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from longboat.comm.buckets import group_params
from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.strategies.zero.flat import FlatUnit, UnitState
from longboat.strategies.zero.init import DeferredInit
from longboat.strategies.zero.policy import ZeroPolicy

_MIB = 1024 * 1024


def bucket_units(
    params: list[nn.Parameter],
    group_of: dict[int, int],
    bucket_mb: float,
    keep: frozenset[int] = frozenset(),
) -> list[list[nn.Parameter]]:
    """Stages 1-2: reverse-order buckets (:func:`~longboat.comm.buckets.group_params`), one
    param group, dtype and device each, and under ``precision.param_dtype`` the parameters
    that keep their own dtype (``keep``) apart from those cast."""
    return group_params(
        params,
        int(bucket_mb * _MIB),
        key=lambda p: (group_of[id(p)], p.dtype, p.device, id(p) in keep),
    )


def runs_forward(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` of its own. Containers (``ModuleList``,
    ``ModuleDict``, ``ParameterList``) have none: their parent calls their children (or reads
    their parameters) directly, so their own forward hooks never fire ([Note: units run
    forward])."""
    return type(module).forward is not nn.Module.forward


def declared_blocks(model: nn.Module) -> list[str]:
    """The repeated block classes a model declares and has: transformers' ``_no_split_modules``
    (``GPT2Block``, ``LlamaDecoderLayer``, ``BertLayer``, ...), from the model or any module in
    it (a user's model may wrap a transformers one)."""
    names = {type(m).__name__ for m in model.modules()}
    out: list[str] = []
    for m in model.modules():
        for c in getattr(m, "_no_split_modules", None) or ():
            if isinstance(c, str) and c in names and c not in out:
                out.append(c)
    return out


def choose_modules(
    model: nn.Module, classes: Iterable[str], min_params: int, by_size: bool = False
) -> list[nn.Module]:
    """The modules made stage-3 units, by the first of: the classes named in
    ``zero.unit_classes``; unless ``by_size`` (the user set ``zero.unit_min_params``), the block
    classes the model declares (:func:`declared_blocks`); size (each module with at least
    ``min_params`` parameters not claimed by a unit below it). Only modules that run forward are
    units ([Note: units run forward])."""
    classes = set(classes)
    names = {type(m).__name__ for m in model.modules()}
    unknown = classes - names
    if unknown:
        raise ConfigError(
            f"key 'zero.unit_classes' names {sorted(unknown)}, which the model does not have; "
            f"its module classes are {sorted(names)}"
        )
    containers = sorted(
        {type(m).__name__ for m in model.modules() if not runs_forward(m)} & classes
    )
    if containers:
        raise ConfigError(
            f"key 'zero.unit_classes' names {containers}, containers whose forward never runs "
            "(their parent calls each child), so their parameters would never be gathered; "
            "name the class of the blocks inside them instead"
        )
    if not classes and not by_size:
        classes = set(declared_blocks(model))
    chosen: list[nn.Module] = []

    def visit(m: nn.Module) -> int:
        # Post-order: a module's size counts only parameters not already claimed by a unit below.
        size = sum(visit(c) for c in m.children())
        size += sum(p.numel() for p in m.parameters(recurse=False))
        if m is model or not runs_forward(m):
            return size  # a container's parameters go up to the unit around it
        if (type(m).__name__ in classes) if classes else size >= min_params:
            chosen.append(m)
            return 0
        return size

    visit(model)
    return chosen


def module_units(
    model: nn.Module,
    trainable: set[int],
    classes: Iterable[str],
    min_params: int,
    by_size: bool = False,
) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Stage 3: (module, its parameters) per unit, in forward registration order, root last
    (units chosen by :func:`choose_modules`)."""
    modules = choose_modules(model, classes, min_params, by_size)
    unit_of: dict[int, int] = {id(m): i for i, m in enumerate(modules)}
    root = len(modules)
    owner: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}

    def visit(m: nn.Module, current: int) -> None:
        current = unit_of.get(id(m), current)
        for p in m.parameters(recurse=False):
            if id(p) not in trainable:
                continue
            params[id(p)] = p
            prev = owner.get(id(p))
            # See [Note: shared parameters].
            owner[id(p)] = current if prev in (None, current) else root
        for c in m.children():
            visit(c, current)

    visit(model, root)
    groups: list[list[nn.Parameter]] = [[] for _ in range(root + 1)]
    for pid, u in owner.items():
        groups[u].append(params[pid])
    return [(m, g) for m, g in zip([*modules, model], groups, strict=True) if g]


@dataclass(frozen=True)
class LowParams:
    """``precision.param_dtype`` as ZeRO applies it ([Note: parameter dtype] in ``gather.py``):
    the dtype units compute (and are gathered) in, and the parameters that keep their own."""

    dtype: torch.dtype
    keep: frozenset[int]  # ids of parameters of KEEP_OWN_DTYPE modules

    @classmethod
    def of(cls, dtype: torch.dtype | None, model: nn.Module) -> LowParams | None:
        if dtype is None:
            return None
        keep = (
            p for m in model.modules() if isinstance(m, KEEP_OWN_DTYPE) for p in m.parameters(False)
        )
        return cls(dtype, frozenset(id(p) for p in keep))


#: Modules whose parameters stay in their own dtype under ``precision.param_dtype``, in units of
#: their own: batch norm (its kernels want the weight in its running statistics' dtype; FSDP's
#: mixed precision keeps it in full precision too) and recurrent layers (autocast runs them in
#: fp32, and the CPU kernels refuse bf16 weights).
KEEP_OWN_DTYPE: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.RNNBase)


def plan_units(
    model: nn.Module,
    params: list[nn.Parameter],
    group_of: dict[int, int],
    cfg: Any,
    by_module: bool,
    isolated: frozenset[int],
    low: LowParams | None = None,
) -> list[tuple[nn.Module | None, list[nn.Parameter]]]:
    """(module, parameters) per unit, in launch order: stage 3's module units (``by_module``)
    or stages 1-2's buckets (module None), every isolated parameter in a unit of its own, and
    under ``low`` the parameters that keep their dtype apart from those gathered in another."""
    if by_module:
        pieces: list[tuple[nn.Module | None, list[nn.Parameter]]] = []
        # A size the user set wins over the blocks a model declares ([Note: units run
        # forward]); the default size is only the fallback.
        by_size = "unit_min_params" in cfg.model_fields_set
        trainable = {id(p) for p in params}
        for module, ps in module_units(
            model, trainable, cfg.unit_classes, cfg.unit_min_params, by_size
        ):
            for chunk in _split(ps, group_of, low.keep if low else frozenset()):
                pieces.append((module, chunk))
        # Launch order approximates backward order: blocks in reverse, but the root unit
        # (embeddings, head) last, since its embedding's gradient is the last to arrive and
        # every later unit would otherwise wait for it ([Note: launch order]).
        root = [pc for pc in pieces if pc[0] is model]
        pieces = [pc for pc in reversed(pieces) if pc[0] is not model] + root
    else:
        keep = low.keep if low else frozenset()
        pieces = [(None, ps) for ps in bucket_units(params, group_of, cfg.bucket_mb, keep)]
    # [Note: tied weights] in tied.py: a weight tied across pipeline stages gets a unit of
    # its own, so its shards line up rank for rank on every stage that holds it.
    return [(m, chunk) for m, ps in pieces for chunk in _isolate(ps, isolated)]


def _isolate(params: list[nn.Parameter], isolated: frozenset[int]) -> list[list[nn.Parameter]]:
    """``params`` as units: each isolated parameter alone, then the others together."""
    rest = [p for p in params if id(p) not in isolated]
    return [[p] for p in params if id(p) in isolated] + ([rest] if rest else [])


def _split(
    params: list[nn.Parameter], group_of: dict[int, int], keep: frozenset[int]
) -> list[list[nn.Parameter]]:
    """``params`` by optimizer group, dtype and device (and whether they keep their dtype
    under ``precision.param_dtype``): a flat unit holds one of each."""
    out: dict[tuple[int, torch.dtype, torch.device, bool], list[nn.Parameter]] = {}
    for p in params:
        out.setdefault((group_of[id(p)], p.dtype, p.device, id(p) in keep), []).append(p)
    return list(out.values())


def stepped_params(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[int, int], list[nn.Parameter]]:
    """The optimizer group of each parameter it steps (by id), and the model's trainable
    parameters it steps, each once, in the model's order: what units hold."""
    group_of = {id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]}
    params = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad and id(p) in group_of]
    return group_of, params


def make_units(
    model: nn.Module,
    pieces: list[tuple[nn.Module | None, list[nn.Parameter]]],
    group_of: dict[int, int],
    comm: Comm,
    policy: ZeroPolicy,
    made: DeferredInit,
    adopt: Callable[[FlatUnit], None],
    low: LowParams | None = None,
) -> list[FlatUnit]:
    """The flat units of :func:`plan_units`' ``pieces``, sharded over ``comm`` and laid out for
    ``policy``'s stage; each handed to ``adopt`` once built (one at a time, so that setup stays
    within what one unit needs). Under ``low`` units compute in ``low.dtype`` ([Note: parameter
    dtype] in ``gather.py``)."""
    module_names = {id(m): n or "root" for n, m in model.named_modules()}
    param_names = {id(p): n for n, p in model.named_parameters()}
    whole: dict[int, list[nn.Parameter]] = {}  # a unit's pieces are made at its first
    for module, ps in pieces:
        whole.setdefault(id(module), []).extend(ps)
    units: list[FlatUnit] = []
    for module, ps in pieces:
        made.unit(whole[id(module)])
        g = group_of[id(ps[0])]
        u = FlatUnit(len(units), ps, g, comm.world_size, comm.rank, module=module)
        # Named in desync and hang reports: two units' tensors may have the same shape.
        what = module_names[id(module)] if module is not None else f"{param_names[id(ps[0])]}, ..."
        u.tag = f"unit {u.index}: {what}"
        # [Note: parameter dtype] in gather.py
        cast = low is not None and low.dtype != u.dtype
        if low is not None and cast and not any(id(p) in low.keep for p in ps):
            u.compute_dtype = low.dtype
        _lay_out(u, policy)
        units.append(u)
        adopt(u)
    return units


def _lay_out(u: FlatUnit, policy: ZeroPolicy) -> None:
    """``u``'s flat buffers as ``policy``'s stage keeps them between steps."""
    if policy.shard_params:
        shard = u.shard = u.flatten(u.lo, u.hi)  # only the shard: the rest is never materialised
        u.release_params()
        u.state = UnitState.SHARDED
    elif u.compute_dtype is not None:
        # [Note: parameter dtype] at stages 1-2: the parameters are views of a whole flat
        # buffer in the compute dtype, the masters a shard of their own in the parameters'
        # dtype; after each step the updated shard is cast and all-gathered into the buffer.
        flat = u.flatten()
        u.flat_param = flat.to(u.compute_dtype)
        u.point_params_at(u.flat_param)
        shard = u.shard = flat[u.lo : u.hi].clone()
        del flat
    else:
        flat = u.flatten()
        u.flat_param = flat
        u.point_params_at(flat)
        shard = u.shard = flat[u.lo : u.hi]  # a view: the step updates flat in place
    u.make_pieces(shard)
    if policy.shard_grads:
        u.grad_shard = torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device)
    else:  # accumulates over the step's micro-batches
        u.flat_grad = torch.zeros(u.padded, dtype=u.dtype, device=u.device)
