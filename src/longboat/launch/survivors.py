"""Keep a job running when a rank it can lose dies (an async or ssp parameter-server worker,
a replica under in-job recovery), and start a replacement in its place when it can have one.

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

A rank whose role is also ``replaceable`` (a replica under in-job recovery) is started again,
while ``--max-restarts`` allows: the same command and environment as the process context
started it with (its ``entrypoint``, ``args`` and ``envs``), its output appended to the same
log files (so the tee'd console shows it), plus ``LONGBOAT_REPLACEMENT_ID``, and the new
process takes the handler's ``proc``. It joins from a live peer ([Note: joining a replacement]
in ``longboat/recovery/joining.py``). --max-restarts is the budget because it already means
"how many failures the job survives by starting processes again" to torchrun users; under
in-job recovery nothing else is restarted, so the same number counts replacements.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from longboat import roles
from longboat.launch.last_words import LastWords, worker_handlers
from longboat.recovery.membership import LEFT_STATUS, publish_death


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
    if code == LEFT_STATUS:
        return "left its replica, which had lost a rank"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"failed with exit code {code}"


def _start_again(pcontext: Any, local_rank: int, handler: Any, new_id: int) -> Any:
    """The process context's worker ``local_rank`` started again with ``new_id`` (its output
    appended to the same files), or None when this torch's context lacks what it takes."""
    try:
        entrypoint = pcontext.entrypoint
        args = pcontext.args[local_rank]
        env = {**os.environ, **pcontext.envs[local_rank]}
        out, err = handler._stdout, handler._stderr
    except (AttributeError, KeyError, TypeError):
        return None
    env[roles.REPLACEMENT_ENV] = str(new_id)
    return subprocess.Popen(
        (entrypoint, *map(str, args)),
        env=env,
        stdout=out,
        stderr=err,
        start_new_session=True,  # as torch's handler: the context ends it by its group
    )


class Survivors:
    """The droppable ranks that died during one launch, and the agent hook that drops them."""

    def __init__(
        self, roles_dir: Path, report: Callable[[str], None], replacements: int = 0
    ) -> None:
        self.roles_dir = roles_dir
        self.report = report
        self.dropped: dict[int, str] = {}  # global rank -> how it ended
        self.replacements = replacements  # left to start (--max-restarts)
        self.replaced: list[tuple[int, int]] = []  # (global rank, id of its replacement)
        self._ids: dict[int, int] = {}  # global rank -> id of its current process
        self._store: Any = None  # the job's store, opened at the first death
        self.last_words = LastWords()  # the others' moment after a failure ([Note: last words])

    def check(self, agent: Any, worker_group: Any) -> int:
        """Drop (or start again) each droppable rank that has ended badly since the last tick;
        how many it took."""
        handlers = worker_handlers(agent)
        if not handlers:
            return 0
        taken = 0
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
            taken += 1
            roles.mark_dead(self.roles_dir, self._ids.get(rank, rank), how)
            self._publish(agent._pcontext, self._ids.get(rank, rank))
            world_size = worker_group.workers[local_rank].world_size
            new_id = rank + world_size * (1 + sum(r == rank for r, _ in self.replaced))
            new = None
            if role.replaceable and self.replacements > 0:
                new = _start_again(agent._pcontext, local_rank, handler, new_id)
            if new is not None:
                handler.proc = new
                # The agent checks its workers' ids against the context's pids at each tick.
                worker_group.workers[local_rank].id = new.pid
                self.replacements -= 1
                self.replaced.append((rank, new_id))
                self._ids[rank] = new_id
                self.report(
                    f"longboat: rank {rank} ({role.what}) {how}; a replacement (pid {new.pid}, "
                    f"id {new_id}) joins from a live peer's state, no checkpoint read "
                    f"({self.replacements} replacement(s) left of --max-restarts)"
                )
                continue
            handler.proc = _Dropped(proc.pid)
            self.dropped[rank] = how
            self.report(
                f"longboat: rank {rank} ({role.what}) {how}; the job goes on without it "
                f"({role.after})"
            )
        return taken

    def _publish(self, pcontext: Any, id: int) -> None:
        """The death of ``id`` in the job's store, for survivors on other nodes ([Note: deaths
        across nodes] in ``longboat/recovery/membership.py``): a client of the store the
        workers reach at ``MASTER_ADDR:MASTER_PORT`` (the agent's), opened at the first
        death. Where it cannot be reached, the survivors wait up to ``recovery.wait_s``."""
        try:
            if self._store is None:
                from datetime import timedelta

                from torch.distributed import TCPStore  # type: ignore[attr-defined]

                env = next(iter(pcontext.envs.values()))
                self._store = TCPStore(
                    env["MASTER_ADDR"],
                    int(env["MASTER_PORT"]),
                    is_master=False,
                    timeout=timedelta(seconds=10),
                )
            publish_death(self._store, id)
        except Exception as e:  # the job goes on; the agreement's window covers it
            self.report(f"longboat: could not publish the death of rank id {id} ({e})")

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
            # A failure the job cannot go on without: the others' last lines first ([Note:
            # last words] in last_words.py), then a droppable rank that ended meanwhile.
            if self.last_words.settle(agent):
                self.check(agent, worker_group)
            result = original(agent, worker_group)
            # A droppable rank that ended between the check and the agent's own look (a
            # replica's last member leaving a moment after its peer died) read as the job's
            # failure: it is dropped now, and the agent looks again.
            failed = getattr(getattr(result, "state", None), "name", "") == "FAILED"
            if failed and self.check(agent, worker_group):
                result = original(agent, worker_group)
            return result

        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
        try:
            yield
        finally:
            LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


__all__ = ["Survivors"]
