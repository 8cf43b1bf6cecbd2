"""``torch.compile`` under every strategy: a model the user compiled, or the config's
``[compile]`` section, compiled where longboat's hooks and collectives stay out of the graphs.

[Note: compiling under a strategy] Dynamo traces a compiled module's forward and inlines the
``__call__`` of every module it calls, forward hooks included. Some of longboat's work around a
forward cannot be part of a graph. ZeRO-3's gather hooks point each parameter's ``data`` at a
freshly gathered buffer: a graph binds its parameters when it is entered, before the hook ran,
so it read them still empty (inductor: "wrong number of dimensions1 for op: input" from its size
checks; aot_eager: an in-place modification of a tensor saved for backward, from the gather
traced into the graph). The tensor-parallel layers' collectives go through longboat's doorways,
Python that counts, checks and logs each transfer. Each of these is marked
``torch.compiler.disable`` where it is defined: dynamo ends its graph before it, runs it as
Python, and compiles what follows as a new graph. What dynamo may trace stays traceable:
``BufferSync``'s forward hook only records that a training forward ran (the broadcast happens
after the backward, outside any graph); backward hooks (replicate's buckets, ZeRO's
reductions, ``_PostBackward``) run in the autograd engine, which compiled graphs do not contain;
the join vote and the pipeline's sends run between forwards.

Where the graphs are cut then follows from what is compiled, always in place, as
``nn.Module.compile`` does (the module's ``_compiled_call_impl``), so parameter names,
``state_dict`` keys and checkpoints are those of the uncompiled model and a checkpoint loads
whichever side compiled:

- ``torch.compile(model)`` passed to ``initialize``: the wrapper is taken off (``_orig_mod``, as
  Accelerate's ``extract_model_from_parallel`` does; its keys would carry an ``_orig_mod.``
  prefix), and the module this rank trains (the model, or this rank's pipeline stages) is
  compiled with the user's own settings (their dynamo context);
- ``compile = true``: one compile per block, as torchtitan does under FSDP2: the modules of
  ``compile.classes``, else the modules a strategy hooks (ZeRO-3's units; the root's unit
  aside), else the repeated blocks the model declares (transformers' ``_no_split_modules``), else
  the whole module. A ZeRO-3 unit compiled alone runs its gather hook, then its forward as one
  graph.

``fullgraph`` cannot hold across a disabled hook: it is refused at ``initialize`` where a
compiled module holds a module the strategy hooks, or with tensor-parallel layers.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch._dynamo import exc as dynamo_exc
from torch._dynamo.eval_frame import OptimizedModule
from torch._subclasses.fake_tensor import FakeTensor

from longboat.config.errors import ConfigError
from longboat.config.sections import CompileConfig
from longboat.strategies.zero.units import declared_blocks

log = logging.getLogger("longboat")

# What a compile can fail with that is the compiler's, not the model's: a backend that raised
# (inductor's errors among them), a graph break under fullgraph, dynamo's own errors. An
# operation that fails on the model's tensors (TorchRuntimeError) would fail uncompiled too and
# is left as it is.
_COMPILE_FAILURES = (
    dynamo_exc.BackendCompilerFailed,
    dynamo_exc.Unsupported,
    dynamo_exc.InternalTorchDynamoError,
)


# The lines dynamo ends its errors with (how to log more).
_ADVICE = ("Set TORCHDYNAMO_VERBOSE", "For even more developer context")


class CompileError(ConfigError):
    """``torch.compile`` refused the settings, or failed on a module; names the key and the
    module."""


def unwrap(model: nn.Module) -> tuple[nn.Module, Any]:
    """``model`` without ``torch.compile``'s wrapper, and that wrapper's dynamo context (None
    when the model was not compiled)."""
    context = None
    while isinstance(model, OptimizedModule):
        context = model.dynamo_ctx
        model = model._orig_mod
    return model, context


def _probe(x: Any) -> Any:
    return x


# torch.compile takes a per-function recompile limit only in recent torch; before that there is
# the global one, named cache_size_limit before it was renamed recompile_limit.
_TAKES_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters
_LIMIT = (
    "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
)


@dataclass
class Compiler:
    """How this run compiles, decided at ``initialize`` before the model is touched."""

    #: ``wrap(fn, recompile_limit)``: ``fn`` compiled (lazily: on its first call)
    wrap: Callable[[Callable[..., Any], int | None], Callable[..., Any]]
    #: where the settings come from, for errors and the log
    source: str
    fullgraph: bool
    #: one compile per block (the config), or of the whole module trained (a compiled model)
    by_block: bool
    classes: tuple[str, ...] = ()
    #: (module, what it had before) for :meth:`restore`
    compiled: list[tuple[nn.Module, Any]] = field(default_factory=list)

    @classmethod
    def plan(cls, cfg: CompileConfig, context: Any) -> Compiler | None:
        """The compiler of ``cfg`` or of the user's ``torch.compile`` (``context``, from
        :func:`unwrap`); None when nothing is compiled. Settings torch refuses are refused
        here, on every rank alike, naming the key."""
        if context is not None and cfg.enabled:
            raise CompileError(
                "the model passed to longboat.initialize is compiled already (torch.compile) "
                "and compile.enabled = true: compile it one way, either pass the model "
                "uncompiled (compile.enabled compiles it block by block) or remove "
                "compile.enabled"
            )
        if context is not None:
            return cls(
                wrap=lambda fn, _limit: context(fn),
                source="torch.compile(model) passed to longboat.initialize",
                fullgraph=bool(getattr(context, "fullgraph", False)),
                by_block=False,
            )
        if not cfg.enabled:
            return None
        kwargs: dict[str, Any] = {
            "backend": cfg.backend,
            "mode": cfg.mode,
            "fullgraph": cfg.fullgraph,
            "dynamic": cfg.dynamic,
            "options": dict(cfg.options) or None,
        }
        from torch._inductor import list_mode_options  # only when compiling: a heavy import

        modes = list(list_mode_options())
        if cfg.mode is not None and cfg.mode not in modes:
            # torch checks a mode only for inductor, and ignores it for other backends
            raise CompileError(
                f"key 'compile.mode' = {cfg.mode!r} is not one of torch.compile's modes "
                f"{modes}; choose one, or remove the key"
            )
        try:  # torch checks backend, mode and options here; compiling waits for a call
            torch.compile(_probe, **kwargs)
        except Exception as e:
            raise CompileError(f"{_settings(cfg)}: torch.compile refused them: {e}") from None

        def wrap(fn: Callable[..., Any], limit: int | None) -> Callable[..., Any]:
            if limit is None:
                return torch.compile(fn, **kwargs)
            if _TAKES_LIMIT:
                # in the keywords: torch's overloads of compile do not list it
                return torch.compile(fn, **{**kwargs, "recompile_limit": limit})
            # Older torch (2.11 on a lent GPU machine refused the keyword) has only the global
            # limit: raised, never lowered, which every compiled function then shares.
            setattr(torch._dynamo.config, _LIMIT, max(getattr(torch._dynamo.config, _LIMIT), limit))
            return torch.compile(fn, **kwargs)

        return cls(
            wrap=wrap,
            source=_settings(cfg),
            fullgraph=cfg.fullgraph,
            by_block=True,
            classes=tuple(cfg.classes),
        )

    def apply(
        self, module: nn.Module, hooked: Sequence[nn.Module], tensor_parallel: bool
    ) -> list[str]:
        """Compile ``module`` (the one this rank trains) in place, or its blocks; ``hooked``:
        the modules whose forward the strategy wraps in hooks (ZeRO-3's units). Returns the
        names of the modules compiled ("" for ``module`` itself)."""
        if any(isinstance(p, FakeTensor) for p in module.parameters()):
            return []  # longboat plan's simulated run: nothing runs that compiling would change
        targets = self._targets(module, hooked)
        if self.fullgraph:
            self._check_whole(targets, hooked, tensor_parallel)
        # Every block compiled here shares its code (nn.Module's call) with the others, and so
        # one cache: each distinct block may need a few graphs (training, evaluation, a shorter
        # last batch) before torch's limit (8 by default) makes it fall back to eager.
        distinct = {(type(m), tuple(p.shape for p in m.parameters())) for _, m in targets}
        limit = max(getattr(torch._dynamo.config, _LIMIT), 4 * len(distinct))
        for name, m in targets:
            self.compiled.append((m, m.__dict__.get("_compiled_call_impl")))
            m._compiled_call_impl = _Guarded(  # nn.Module.compile's attribute
                self.wrap(m._call_impl, limit), _describe(name, m), self.source, self.fullgraph
            )
        names = [name or "the whole model" for name, _ in targets]
        more = f" and {len(names) - 6} more" if len(names) > 6 else ""
        log.info("compile: %s with %s%s", ", ".join(names[:6]), self.source, more)
        return [name for name, _ in targets]

    def restore(self) -> None:
        """Each compiled module's call as it was before :meth:`apply` (at the engine's close)."""
        for m, before in reversed(self.compiled):
            m._compiled_call_impl = before
        self.compiled.clear()

    def _targets(
        self, module: nn.Module, hooked: Sequence[nn.Module]
    ) -> list[tuple[str, nn.Module]]:
        """The modules compiled, outermost first found, none inside another."""
        if not self.by_block:
            return [("", module)]
        named = list(module.named_modules())
        present = {type(m).__name__ for _, m in named}
        if self.classes:
            unknown = sorted(set(self.classes) - present)
            if unknown:
                raise CompileError(
                    f"key 'compile.classes' names {unknown}, which the model trained here does "
                    f"not have; its module classes are {sorted(present)}"
                )
            return _outermost(named, lambda m: type(m).__name__ in self.classes)
        ids = {id(m) for m in hooked if m is not module}
        if ids:
            return _outermost(named, lambda m: id(m) in ids)
        declared = set(declared_blocks(module))
        if declared:
            return _outermost(named, lambda m: type(m).__name__ in declared)
        return [("", module)]

    def _check_whole(
        self,
        targets: list[tuple[str, nn.Module]],
        hooked: Sequence[nn.Module],
        tensor_parallel: bool,
    ) -> None:
        """fullgraph: refuse what cannot be one graph ([Note: compiling under a strategy])."""
        fix = (
            "compile.fullgraph = false"
            if self.by_block
            else "torch.compile(model) without fullgraph, or pass the model uncompiled with "
            "compile = {enabled = true, fullgraph = true, classes = [...]} naming modules inside "
            "them"
        )
        ids = {id(m) for m in hooked}
        for name, target in targets:
            inside = [(n, m) for n, m in target.named_modules() if id(m) in ids]
            if inside:
                held = ", ".join(_describe(f"{name}.{n}".strip("."), m) for n, m in inside[:3])
                raise CompileError(
                    f"{self.source} asks for one graph (fullgraph) of {_describe(name, target)}, "
                    f"which holds {held}: the strategy gathers their parameters in hooks around "
                    f"their forward, which run between compiled graphs; use {fix}"
                )
        if tensor_parallel:
            raise CompileError(
                f"{self.source} asks for one graph (fullgraph) with tensor-parallel layers "
                "(mesh.tp > 1), whose collectives run between compiled graphs; use " + fix
            )


class _Guarded:
    """A module's compiled call; a failure of the compiler is named with the module and the
    settings (every rank compiles the same module at the same call, so every rank raises)."""

    def __init__(self, fn: Callable[..., Any], what: str, source: str, fullgraph: bool) -> None:
        self.fn = fn
        self.what = what
        self.source = source
        self.fullgraph = fullgraph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except _COMPILE_FAILURES as e:
            if isinstance(e, dynamo_exc.Unsupported) and self.fullgraph:
                fix = "allow graph breaks (fullgraph off)"
            elif isinstance(e, dynamo_exc.BackendCompilerFailed):
                fix = (
                    "the backend failed: backend 'aot_eager' (no code generation) shows "
                    "whether it is the backend's doing; or compile nothing"
                )
            else:
                fix = "compile nothing, or compile other modules (compile.classes)"
            # dynamo's own message, without its closing advice on logging
            lines = [line for line in str(e).splitlines() if line.strip()]
            lines = [line for line in lines if not line.startswith(_ADVICE)][:3]
            raise CompileError(
                f"compiling {self.what} with {self.source} failed: {' '.join(lines)}; {fix}"
            ) from e


def _outermost(
    named: list[tuple[str, nn.Module]], chosen: Callable[[nn.Module], bool]
) -> list[tuple[str, nn.Module]]:
    """The chosen modules of ``named`` (``named_modules()`` order) not inside another."""
    out: list[tuple[str, nn.Module]] = []
    for name, m in named:
        if chosen(m) and not any(name.startswith(f"{n}.") or not n for n, _ in out):
            out.append((name, m))
    return out


def _describe(name: str, m: nn.Module) -> str:
    return f"module {name!r} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"


def _settings(cfg: CompileConfig) -> str:
    given = {k: getattr(cfg, k) for k in ("backend", "mode", "fullgraph", "dynamic", "options")}
    shown = ", ".join(
        f"compile.{k} = {v!r}"
        for k, v in given.items()
        if k == "backend" or v not in (None, False, {})
    )
    return f"[compile] {shown}"
