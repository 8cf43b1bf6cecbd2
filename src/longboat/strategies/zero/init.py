"""Deferred initialisation for ZeRO-3: a model built on the meta device, made unit by unit.

[Note: deferred init] A model whose parameters alone exceed a rank's memory cannot be built
whole and then sharded. Built under ``torch.device("meta")`` it takes no memory; ZeRO-3 then
makes each unit's parameters just before flattening the unit, and the unit keeps its shard and
frees the rest before the next unit is made: setup needs one unit's full parameters at a time,
not the model's (a unit cut in pieces by parameter group is made whole, once).

Making a unit. Every module that directly owns one of its parameters (an *owner*) gets real
(CPU) tensors in place of its meta parameters and buffers: the same objects with the same
attributes, so the user's optimizer and tied weights (one ``Parameter`` held by two modules)
still refer to them and nothing needs re-tying. The modules then initialised are the owners and
every module whose whole subtree's parameters were made just now, with its descendants (a
container such as transformers' ``GPT2Attention``, which rescales its child ``c_proj``), never a
module holding a parameter of another unit (still on meta, or flattened already): a module whose
parameters span units (the root, ``nn.ModuleList``; or a block when ``zero.unit_classes`` names
smaller modules inside it) is not given to the model's initialiser, so units should be no smaller
than what it treats as one (transformers' blocks, the default units, are). The first of these
initialises them:

1. ``param_init_fn(module)``, given to ``longboat.initialize`` (FSDP's name), on each module
   that owns a tensor just made, children before parents;
2. the model's own initialiser: ``model.<zero.init_method>(module)``, or without that key the
   ``_init_weights(module)`` of the nearest enclosing transformers ``PreTrainedModel`` (what its
   ``post_init()`` applies to every module, except under the meta device, where it only ties
   the weights) or longboat's ``models.GPT``. As eagerly: first each module's
   own ``reset_parameters()`` (its constructor's values), then the initialiser on every module,
   children before parents as ``nn.Module.apply`` goes;
3. each module's own ``reset_parameters()``, as FSDP does without a ``param_init_fn``.

Every new tensor is filled beforehand with a value no initialisation leaves (NaN; an integer
type's minimum), and one still holding it afterwards is refused by name, as is a function that
raises. All ranks make the same calls, so their random states move alike; they then agree
(a small all-reduce on the control plane) on whether any rank failed, so that a failure on one
rank is an error naming it on every rank rather than a broadcast waiting on rank 0, and rank 0's
values are broadcast over the data-parallel group.

[Note: placing parameters] With its parameters in host memory beside an accelerator ([Note:
host parameter offload] in ``host.py``), ZeRO-3 brings a model built on the CPU to the device
the same way: the engine moves the buffers and frozen parameters and leaves the trainable ones
where the user built them (``Strategy.places_parameters``), and each unit's parameters are moved
to the device and broadcast just before the unit is flattened, which then keeps only its host
master. The device holds one unit's parameters at a time during setup, as for a model built on
the meta device: a model larger than the device trains whether it was built on the CPU or on
meta (as DeepSpeed's ZeRO-3 with ``offload_param`` partitions a model built on the CPU).

After the last unit, modules with buffers still on meta (transformers' rotary embedding, which
``LlamaModel`` holds outside its layers: its ``_init_weights`` recomputes ``inv_freq``) are made
the same way. A frozen parameter on meta in a module without trainable ones is refused: ZeRO-3
does not shard frozen parameters, so each rank would hold them whole; build them on a device.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.models import GPT
from longboat.placement import device_made, planning_for_accelerator

InitFn = Callable[[nn.Module], object]


class _OwnInit(Protocol):
    """A model class that initialises each of its modules itself (GPT, transformers' models)."""

    def _init_weights(self, module: nn.Module) -> object: ...


_BUFFER_HINT = (
    "; or keep buffers off the meta device when building the model (accelerate's "
    "init_empty_weights() does: include_buffers=False, its default)"
)


class DeferredInit:
    """Makes the units of a model built on the meta device real and initialised
    ([Note: deferred init]). Without tensors on meta, every method does nothing."""

    def __init__(
        self,
        model: nn.Module,
        dp: Comm,
        control: Comm,
        param_init_fn: InitFn | None = None,
        init_method: str | None = None,
        device: torch.device | None = None,
        placing: list[nn.Parameter] | None = None,
    ) -> None:
        if init_method is not None and not callable(getattr(model, init_method, None)):
            raise ConfigError(
                f"key 'zero.init_method' has value {init_method!r}, but "
                f"{type(model).__name__} has no method {init_method!r}: name the model's "
                "initialiser, called as model.<name>(module) on each module made "
                "(transformers' '_init_weights'), or remove the key"
            )
        self.model, self.dp, self.control = model, dp, control
        # Where this rank computes: tensors are made and initialised on the CPU (the values an
        # eager build draws there), then moved there, one unit at a time, before the broadcast
        # (NCCL's collectives take device tensors).
        self.device = device if device is not None and device.type != "cpu" else None
        # [Note: placing parameters]: those still where the user built them, by id; the
        # trainable ones no unit holds (the optimizer does not step them) go now
        self._placing: dict[int, nn.Parameter] = {}
        if placing is not None and (self.device is not None or planning_for_accelerator()):
            away = {
                id(p): p for p in model.parameters() if not p.is_meta and p.device != self.device
            }
            self._placing = {id(p): p for p in placing if id(p) in away}
            for k, p in away.items():
                if k not in self._placing:
                    self._bring(p)
        self.param_init_fn = param_init_fn
        self.active = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if not self.active:
            if param_init_fn is not None or init_method is not None:
                logging.getLogger("longboat").warning(
                    "param_init_fn / zero.init_method: the model has nothing on the meta "
                    "device, so nothing is initialised by them"
                )
            return
        self.order = list(_post_order(model))
        self.names = {id(m): n or "the model" for n, m in model.named_modules()}
        # The parameters of each module's subtree: a module is initialised with a unit only if
        # all of them are made with it ([Note: deferred init]).
        self.below: dict[int, frozenset[int]] = {}
        for m in self.order:
            own = {id(p) for p in m.parameters(recurse=False)}
            self.below[id(m)] = frozenset(own.union(*(self.below[id(c)] for c in m.children())))
        self.initialiser = self._initialisers(init_method)
        if param_init_fn is not None:
            self.how = f"param_init_fn {_name(param_init_fn)}"
        elif self.initialiser:
            fns = dict.fromkeys(label for label, _ in self.initialiser.values())
            self.how = f"reset_parameters() and {', '.join(fns)}"
        else:
            self.how = "reset_parameters()"
        logging.getLogger("longboat").info(
            "deferred init: the model's meta tensors are made unit by unit with %s", self.how
        )

    def _initialisers(self, init_method: str | None) -> dict[int, tuple[str, InitFn]]:
        """The model's own initialiser of each module it applies to (by module id)."""
        if init_method is not None:
            fn = getattr(self.model, init_method)
            label = f"{type(self.model).__name__}.{init_method}"
            return {id(m): (label, fn) for m in self.order}
        hf = sys.modules.get("transformers.modeling_utils")  # imported if the model is one
        known: tuple[type[_OwnInit], ...] = (GPT, hf.PreTrainedModel) if hf is not None else (GPT,)
        out: dict[int, tuple[str, InitFn]] = {}

        # Each module to its nearest enclosing known model's, as transformers dispatches
        # a composite model's submodels to their own _init_weights.
        def walk(m: nn.Module, current: tuple[str, InitFn] | None) -> None:
            if isinstance(m, known):
                current = (f"{type(m).__name__}._init_weights", m._init_weights)
            if current is not None:
                out[id(m)] = current
            for c in m.children():
                walk(c, current)

        walk(self.model, None)
        return out

    def _bring(self, p: nn.Parameter) -> None:
        """``p`` to the device; in the planner's run for an accelerator, to a copy it counts
        there ([Note: planning host offload] in ``placement.py``)."""
        if self.device is not None:
            p.data = p.data.to(self.device)
        else:
            p.data = device_made(p.data.clone())

    def places(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is brought to the device with its unit ([Note: placing parameters])."""
        return id(t) in self._placing

    @torch.no_grad()
    def unit(self, params: list[nn.Parameter]) -> None:
        """Make the modules of a unit whose parameters (all its pieces') are ``params``, and
        bring those still where the user built them ([Note: placing parameters])."""
        for p in dict.fromkeys(params):
            if self._placing.pop(id(p), None) is not None:
                self._bring(p)
                self.dp.broadcast(p.data, src=0)
        if not self.active:
            return
        wanted = {id(p) for p in params if p.is_meta}
        if not wanted:
            return
        owners = {
            id(m) for m in self.order if any(id(p) in wanted for p in m.parameters(recurse=False))
        }
        now = {
            id(p)
            for m in self.order
            if id(m) in owners
            for p in m.parameters(recurse=False)
            if p.is_meta
        }
        # The modules whose whole subtree is made now, with their descendants (those without
        # parameters among them), and the owners.
        inside: set[int] = set()
        for m in reversed(self.order):  # parents before their descendants
            below = self.below[id(m)]
            if id(m) in inside or (below and below <= now):
                inside.add(id(m))
                inside.update(id(c) for c in m.children())
        inside |= owners
        self._make([m for m in self.order if id(m) in inside])

    @torch.no_grad()
    def finish(self) -> None:
        """After the last unit: refuse frozen parameters left on meta, make buffers left."""
        if not self.active:
            return
        left = [n for n, p in self.model.named_parameters() if p.is_meta]
        if left:
            raise ConfigError(
                f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''} stayed on the meta "
                "device: ZeRO-3 makes trainable parameters and buffers only (see [Note: "
                "deferred init] in longboat/strategies/zero/init.py); build frozen parameters "
                "on a device"
            )
        self._make([m for m in self.order if any(b.is_meta for b in m.buffers(recurse=False))])

    def _make(self, modules: list[nn.Module]) -> None:
        """Make ``modules``' meta tensors real, initialise them, agree, broadcast rank 0's."""
        made: list[tuple[nn.Module, str, torch.Tensor]] = []
        for m in modules:
            for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                if t.is_meta:
                    _make_real(t)
                    made.append((m, name, t))
        if not made:
            return
        # Owners of a tensor made now: both holders of a tied weight, whichever made it.
        ids = {id(t) for _, _, t in made}
        owners = {
            id(m)
            for m in modules
            if any(id(t) in ids for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
        }
        calls = self._calls(modules, owners)
        failed, error = 0, None
        for i, (_, _, call) in enumerate(calls):
            try:
                call()
            except Exception as e:  # any error of the user's code, reported on every rank
                failed, error = i + 1, e
                break
        unset = [] if failed else [(m, n) for m, n, t in made if _unset(t)]
        if unset:
            failed = len(calls) + 1
        if self.control.world_size == 1:  # no one to agree with (the planner's run too)
            if failed:
                self._fail([failed], calls, error, unset)
        else:
            codes = torch.zeros(self.control.world_size, dtype=torch.int64)
            codes[self.control.rank] = failed
            self.control.all_reduce(codes, tag="deferred init")
            if codes.any():
                self._fail(codes.tolist(), calls, error, unset)
        for _, _, t in made:
            if self.device is not None:
                t.data = t.data.to(self.device)
            self.dp.broadcast(t.data, src=0)

    def _calls(
        self, modules: list[nn.Module], owners: set[int]
    ) -> list[tuple[nn.Module, str, Callable[[], object]]]:
        """What initialises ``modules`` (children before parents), labelled for errors."""
        if self.param_init_fn is not None:
            fn = self.param_init_fn
            label = f"param_init_fn {_name(fn)}"
            return [(m, label, _bind(fn, m)) for m in modules if id(m) in owners]
        calls: list[tuple[nn.Module, str, Callable[[], object]]] = []
        for m in modules:  # what each module's constructor did
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                calls.append((m, f"{type(m).__name__}.reset_parameters", reset))
        for m in modules:  # then what the model's constructor did after
            if id(m) in self.initialiser:
                label, init = self.initialiser[id(m)]
                calls.append((m, label, _bind(init, m)))
        return calls

    def _fail(
        self,
        codes: list[int],
        calls: list[tuple[nn.Module, str, Callable[[], object]]],
        error: Exception | None,
        unset: list[tuple[nn.Module, str]],
    ) -> None:
        """Raise on every rank: this rank's own error, or the first failed rank's."""
        rank = self.control.rank
        if codes[rank] > len(calls):
            m = unset[0][0]
            what = ", ".join(self._name(o, n) for o, n in unset[:5])
            buffers = any(n in dict(o.named_buffers(recurse=False)) for o, n in unset)
            raise ConfigError(
                f"{what}{' ...' if len(unset) > 5 else ''} stayed uninitialised after "
                f"{self.how} ran on the meta device's model ([Note: deferred init] in "
                f"longboat/strategies/zero/init.py): give {type(m).__name__} a "
                "reset_parameters(), initialise it in the model's initialiser "
                "(zero.init_method), or pass param_init_fn to longboat.initialize"
                f"{_BUFFER_HINT if buffers else ''}"
            )
        if codes[rank]:
            m, label, _ = calls[codes[rank] - 1]
            raise RuntimeError(
                f"{label} raised on module {self._name(m)!r} ({type(m).__name__}) while making "
                f"the meta device's model: {type(error).__name__}: {error}"
            ) from error
        other = next(r for r, c in enumerate(codes) if c)
        if codes[other] > len(calls):
            where = "left tensors uninitialised"
        else:
            m, label, _ = calls[codes[other] - 1]
            where = f"{label} raised on module {self._name(m)!r}"
        raise RuntimeError(
            f"making the meta device's model failed on rank {self.control.global_rank(other)}"
            f" ({where}); its own error says why"
        )

    def _name(self, m: nn.Module, tensor: str = "") -> str:
        """``m``'s name in the model, or that of its tensor called ``tensor``."""
        name = self.names.get(id(m), type(m).__name__)
        if not tensor:
            return name
        return tensor if m is self.model else f"{name}.{tensor}"


def _post_order(model: nn.Module) -> Iterator[nn.Module]:
    """Every module once, children before parents (as ``nn.Module.apply`` visits them)."""
    seen: set[int] = set()

    def walk(m: nn.Module) -> Iterator[nn.Module]:
        if id(m) in seen:
            return
        seen.add(id(m))
        for c in m.children():
            yield from walk(c)
        yield m

    yield from walk(model)


def _make_real(t: torch.Tensor) -> None:
    """Give meta tensor ``t`` CPU memory in place (the same object and attributes), filled with
    what no initialisation leaves, so that a tensor left uninitialised is seen (``_unset``)."""
    real = torch.empty(t.shape, dtype=t.dtype)
    if t.is_floating_point() or t.is_complex():
        real.fill_(float("nan"))
    elif t.dtype != torch.bool:
        real.fill_(torch.iinfo(t.dtype).min)
    if isinstance(t, nn.Parameter):
        real = nn.Parameter(real, t.requires_grad)
    # swap_tensors swaps the attributes too; keep the user's (transformers' flag that a tensor
    # was loaded is wrong for one on meta: its guarded init functions would skip it).
    attrs = {k: v for k, v in t.__dict__.items() if k != "_is_hf_initialized"}
    real.__dict__.update(attrs)
    torch.utils.swap_tensors(t, real)  # type: ignore[no-untyped-call]  # torch's is unannotated


def _unset(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds ``_make_real``'s filling somewhere (a fake tensor, in the
    planner's run, has no values to tell: trusted)."""
    if isinstance(t, FakeTensor):
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return False  # no value to tell: trusted
    return bool((t == torch.iinfo(t.dtype).min).any())


def _bind(fn: InitFn, m: nn.Module) -> Callable[[], object]:
    return lambda: fn(m)


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


__all__ = ["DeferredInit", "InitFn"]
