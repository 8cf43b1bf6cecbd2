"""Guard rails for the package's shape: no import cycles, lower layers never import higher ones.

An import counts wherever it is written (at the top, in a function, under ``TYPE_CHECKING``):
a cycle hidden in a local import is still a cycle. ``from pkg import mod`` where ``mod`` is a
module depends on that module, not on the package's ``__init__``.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Layers, lowest first: a module may import its own layer and those below, never above.
LAYERS = [
    {
        "longboat.config",
        "longboat.mesh",
        "longboat.world",
        "longboat.roles",
        "longboat.network",
        "longboat.heap",
        # torch's CPU allocator given a pool (beside heap.py); imports nothing of longboat.
        "longboat.cpu_pool",
        # A launch module, but pure and importing nothing of longboat: world.py reads Slurm's
        # node list and port with the same functions `longboat run` uses.
        "longboat.launch.node_env",
        # What checkpoints see of any strategy's state; imports nothing of longboat.
        "longboat.pieces",
        # Where a rank's tensors live beside an accelerator, for the planner's counter; imports
        # nothing of longboat.
        "longboat.placement",
    },
    {
        "longboat.comm",
        "longboat.data",
        "longboat.evaluation",
        "longboat.topology",
        "longboat.models",
    },
    {
        "longboat.strategies",
        "longboat.precision",
        "longboat.checkpoint",
        "longboat.observe",
        "longboat.optim",
        "longboat.grads",
        "longboat.pipeline.schedule",
        "longboat.pipeline",
        "longboat.recompute",
        "longboat.pipeline.tied",
        "longboat.tensor",
        "longboat.ps",
        "longboat.sync_batchnorm",
        "longboat.join",
        "longboat.compile",
        "longboat.recovery",
    },
    {"longboat.engine"},
    {
        "longboat.launch",
        "longboat.bench",
        "longboat.plan",
        "longboat.tune",
        "longboat.cli",
        "longboat.testing",
        "longboat",
    },
]


@functools.cache
def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "longboat").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [s for s in subs if s in mods] or [node.module]
            else:
                continue
            graph[m] |= {t for t in targets if t in mods and t != m}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def _layer(module: str) -> int:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            inside = module == prefix or module.startswith(prefix + ".")
            if inside and (best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def test_lower_layers_never_import_higher_ones():
    graph = _graph()
    up = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m in sorted(graph)
        for t in sorted(graph[m])
        if _layer(t) > _layer(m)
    ]
    assert not up, "\n".join(up)


def _imported_on_import(path: Path, mods: dict[str, Path], me: str) -> set[str]:
    """The modules importing ``me`` runs: its top-level imports (also inside top-level ``if`` and
    ``try``), not those in functions or under ``TYPE_CHECKING``."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                out.update([s for s in subs if s in mods] or [node.module])

    visit(ast.parse(path.read_text()).body)
    return {m for m in out if m in mods and m != me}


def test_import_floors_stay_at_most_ten():
    """A module's floor is the longest chain of longboat modules importing it runs (0: it
    imports none). Ten floors keep the package shallow enough to read from the bottom up."""
    mods = _modules()
    graph = {m: _imported_on_import(p, mods, m) for m, p in mods.items()}

    @functools.cache
    def floor(m: str) -> tuple[int, tuple[str, ...]]:
        below = [floor(t) for t in graph[m]]
        if not below:
            return 0, (m,)
        f, chain = max(below)
        return f + 1, (m, *chain)

    worst = max(floor(m) for m in mods)
    assert worst[0] <= 10, " -> ".join(worst[1])


def test_every_module_imports_first() -> None:
    """Each module can be the first of longboat a program imports: a cycle that the order of
    imports hides (a package whose ``__init__`` imports a module that imports the package back)
    fails here. One interpreter, longboat's modules forgotten before each import."""
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    for m in [m for m in sys.modules if m == 'longboat' or m.startswith('longboat.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
    )
    names = sorted(m for m in _modules() if not m.endswith("__main__"))
    # Two interpreters, every other module each: the check is CPU-bound and the suite otherwise
    # leaves the second core idle while it runs.
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *names[half::2]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for half in (0, 1)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        assert out.strip() == "", out


def test_no_module_is_over_500_lines() -> None:
    """A file one reads in a sitting: over 500 lines, split it by purpose."""
    long = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
