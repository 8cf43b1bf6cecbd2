"""How the engine ends: close(), and the close at exit of an engine the script never closed.
The engine inherits these (``longboat.engine.core.Engine``)."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from typing import Any, Protocol

from longboat.checkpoint import Checkpointing
from longboat.compile import Compiler
from longboat.observe.monitor import Monitor
from longboat.strategies.base import Strategy
from longboat.tensor import TensorParallel
from longboat.topology import Topology
from longboat.world import World, destroy_process_group


class _Engine(Protocol):
    """What these methods use of the engine."""

    _closed: bool
    _atexit: Callable[[], None]
    _owns_group: bool
    monitor: Monitor
    strategy: Strategy
    compiler: Compiler | None
    checkpointing: Checkpointing
    comm: Any
    world: World
    tensor: TensorParallel
    topology: Topology

    def _release(self) -> None: ...


def leave_if_alive(ref: Callable[[], Any]) -> None:
    """At exit: leave as the engine ``ref`` refers to (a weak reference) leaves, if it is still
    alive ([Note: leaving at exit])."""
    engine = ref()
    if engine is not None:
        engine._leave()


class Closing:
    """The engine's end; every rank calls close() together."""

    def close(self: _Engine) -> None:
        """Finish progress output, remove hooks, hand back an ordinary model (ZeRO-3 gathers
        its parameters: every rank closes together) and leave the process group if we joined
        it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self.monitor.close()
        self.strategy.close()
        self._release()

    def _leave(self: _Engine) -> None:
        """close() at exit, for an engine never closed: no collective ([Note: leaving at
        exit])."""
        if self._closed:
            return
        self._closed = True
        self.monitor.close(gather=False)
        self.strategy.leave()
        self._release()

    # Note [leaving at exit]
    # ~~~~~~~~~~~~~~~~~~~~~~
    # An engine the script never closes is closed at exit, so the process leaves its groups.
    # By then the ranks may hold different engines: the registry keeps only weak references,
    # and an engine one rank dropped may have been collected there and not on another (a
    # script that builds engines in a loop, as tests/launch_scripts/ds_side_by_side.py does).
    # Closing as close() does would make each rank wait in a different engine's collective
    # (ZeRO-3's gathers that hand the model back, the profiler's summary) until comm.timeout_s
    # (tests/test_engine_exit.py). So the exit closes with no collective: hooks, buffers and
    # files are released, the model is not handed back (nobody uses it after exit), and the
    # profiler's table is left to close().

    def _release(self: _Engine) -> None:
        if self.compiler is not None:
            self.compiler.restore()
        self.checkpointing.stop.uninstall()
        commlog = getattr(self.comm, "commlog", None)
        if commlog is not None and self.world.is_main:
            # Rank 0's view of the data-parallel traffic (and of its tensor-parallel layers');
            # every rank's numbers are in engine.comm.log_summary().
            print(commlog.table(), end="", flush=True)
            layers = getattr(self.tensor.comm, "commlog", None)
            if layers is not None and self.tensor.active:
                print(layers.table("tp"), end="", flush=True)
        self.topology.close()
        if self._owns_group:
            destroy_process_group()
