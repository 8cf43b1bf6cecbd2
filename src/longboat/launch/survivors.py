"""Keep a job running when a rank it can lose dies (an async or ssp parameter-server worker).

torch elastic's agent ends every worker as soon as one fails: its process context stops the
others at the first non-zero exit. A rank that announced itself ``droppable`` ([Note: rank
roles] in ``longboat/roles.py``) is looked at first, at each of the agent's monitor ticks: when
it has ended badly, the launcher reports it once and hands the agent a process that reads as
ended with status 0, so the others train on and the job ends when they do. The servers have
already noticed the death (heartbeats) and drop the worker themselves.

[Note: keeping survivors] This reaches into the agent: ``LocalElasticAgent._monitor_workers``
is wrapped for the time of one launch, and the process context's ``subprocess_handlers[i].proc``
is replaced (``longboat run`` always starts a binary, so the context is a subprocess one). The
attributes are checked, and without them the agent's own rule (every failure stops the job)
stays in force, with one line saying so. There is no public hook for this in torch elastic.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from longboat import roles


class _Dropped:
    """Stands for a dropped rank's ended process: it reads as ended with status 0."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def send_signal(self, sig: int) -> None:
        pass

    def kill(self) -> None:
        pass

    def terminate(self) -> None:
        pass


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"failed with exit code {code}"


class Survivors:
    """The droppable ranks that died during one launch, and the agent hook that drops them."""

    def __init__(self, roles_dir: Path, report: Callable[[str], None]) -> None:
        self.roles_dir = roles_dir
        self.report = report
        self.dropped: dict[int, str] = {}  # global rank -> how it ended

    def check(self, agent: Any, worker_group: Any) -> None:
        """Drop each droppable rank that has ended badly since the last tick."""
        handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
        if not handlers:
            return
        known: dict[int, roles.Role] | None = None
        for local_rank, handler in handlers.items():
            proc = getattr(handler, "proc", None)
            if proc is None or isinstance(proc, _Dropped):
                continue
            code = proc.poll()
            if code is None or code == 0:
                continue
            if known is None:
                known = roles.read(self.roles_dir)
            rank = worker_group.workers[local_rank].global_rank
            role = known.get(rank)
            if role is None or not role.droppable:
                continue  # the agent's rule: the job stops
            how = _how(code)
            handler.proc = _Dropped(proc.pid)
            self.dropped[rank] = how
            roles.mark_dead(self.roles_dir, rank, how)
            self.report(
                f"longboat: rank {rank} ({role.what}) {how}; the job goes on without it "
                f"({role.after})"
            )

    def all_failed(self) -> str | None:
        """Each droppable rank that died, in words, when every one of them did (None
        otherwise): the job then trained nothing to its end, whatever status its servers
        exit with (a worker that raised still says goodbye to them from its exit handler)."""
        droppable = {r for r, role in roles.read(self.roles_dir).items() if role.droppable}
        if not droppable or not droppable <= set(self.dropped):
            return None
        return ", ".join(f"rank {r} {self.dropped[r]}" for r in sorted(droppable))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Wrap the agent's monitor tick for the time of one launch ([Note: keeping
        survivors])."""
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        original = getattr(LocalElasticAgent, "_monitor_workers", None)
        if original is None:
            self.report(
                "longboat: this torch's elastic agent has no _monitor_workers: any rank that "
                "dies stops the job, parameter-server workers included"
            )
            yield
            return

        def monitor(agent: Any, worker_group: Any) -> Any:
            self.check(agent, worker_group)
            return original(agent, worker_group)

        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
        try:
            yield
        finally:
            LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


__all__ = ["Survivors"]
