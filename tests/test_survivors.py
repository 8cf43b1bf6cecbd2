"""The launcher's survivors hook ([Note: keeping survivors] in ``longboat/launch/survivors.py``)
against the agent's own look at its workers, with stand-ins for the agent and its processes."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from longboat import roles
from longboat.launch.survivors import Survivors
from longboat.recovery.membership import LEFT_STATUS


class _LeavesAfterFirstLook:
    """A process that is running at its first poll and has ended (left its replica) after."""

    def __init__(self, pid: int) -> None:
        self.pid, self.polls = pid, 0

    def poll(self) -> int | None:
        self.polls += 1
        return None if self.polls == 1 else LEFT_STATUS


def test_a_rank_that_leaves_between_the_check_and_the_agents_look_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    role = roles.Role("replica 0", droppable=True, after="the others regroup without it")
    for rank in (0, 1):
        Path(tmp_path, f"rank{rank}.json").write_text(json.dumps(asdict(role)))
    handlers = {r: SimpleNamespace(proc=_LeavesAfterFirstLook(100 + r)) for r in (0, 1)}
    agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers=handlers))
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=r, world_size=2) for r in (0, 1)])

    def agents_look(agent: Any, worker_group: Any) -> Any:  # the agent's rule: any failure
        codes = [h.proc.poll() for h in agent._pcontext.subprocess_handlers.values()]
        failed = any(c not in (None, 0) for c in codes)
        return SimpleNamespace(state=SimpleNamespace(name="FAILED" if failed else "HEALTHY"))

    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", agents_look)
    reports: list[str] = []
    survivors = Survivors(tmp_path, reports.append)
    monkeypatch.setattr(survivors, "_publish", lambda pcontext, id: None)  # no store here
    with survivors.watching():
        result = LocalElasticAgent._monitor_workers(agent, group)  # type: ignore[call-arg]
    # Both ended after the hook's first look and before the agent's: dropped, not a failure.
    assert result.state.name == "HEALTHY", reports
    assert sorted(survivors.dropped) == [0, 1]
    assert all("left its replica" in line for line in reports), reports
