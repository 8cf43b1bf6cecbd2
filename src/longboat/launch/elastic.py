"""An elastic node: ``longboat run -n MIN:MAX`` restarts without the slots of failed workers.

[Note: elastic node] The node starts MAX workers. When an attempt fails and ``--max-restarts``
allows another, the new attempt starts one worker fewer, never fewer than MIN: the slot of the
worker that failed first is taken as lost (the device it ran on died), as torchrun's ``--nnodes
MIN:MAX`` takes a lost node. One slot per failed attempt, not one per failed worker: when one
worker dies its peers fail too, of the lost peer, and they are no reason to shrink. Every
worker sees the new ``WORLD_SIZE``; a script that resumes from its last checkpoint
(``engine.load_checkpoint``) gets it resharded to the new world size, since longboat's
checkpoints load at any size. Restarting at the same
size (plain ``-n N``) is unchanged.

torch elastic's agent fixes its worker count when it is built (``WorkerSpec.local_world_size``)
and has no hook between attempts, so the launcher gives it a subclass for the length of the
launch that lowers that count just before each restart; the rendezvous then assigns ranks and
``WORLD_SIZE`` from it, as it does for the first attempt.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent


class ShrinkingAgent(LocalElasticAgent):
    """torch's local agent, restarting with the failed workers' slots given up ([Note: elastic
    node])."""

    def __init__(self, *args: Any, least: int, report: Callable[[str], None], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._least = least
        self._report = report
        self._most = self._worker_group.spec.local_world_size

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        now = spec.local_world_size
        fewer = max(self._least, now - 1)
        if fewer != now:
            self._report(
                f"longboat: the next attempt starts {fewer} workers instead of {now} (-n "
                f"{self._least}:{self._most}: a failed worker's slot is given up)"
            )
            spec.local_world_size = fewer
        else:
            self._report(f"longboat: the next attempt starts {now} workers, the fewest -n allows")
        super()._restart_workers(worker_group)


@contextlib.contextmanager
def elastic_node(least: int, report: Callable[[str], None]) -> Iterator[None]:
    """While open, the agents torch's launcher builds are :class:`ShrinkingAgent`s."""
    saved = getattr(launcher_api, "LocalElasticAgent")  # noqa: B009 (not exported; we swap it)
    setattr(  # noqa: B010 (the name launch_agent looks up when it builds its agent)
        launcher_api,
        "LocalElasticAgent",
        functools.partial(ShrinkingAgent, least=least, report=report),
    )
    try:
        yield
    finally:
        setattr(launcher_api, "LocalElasticAgent", saved)  # noqa: B010
