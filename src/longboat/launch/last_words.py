"""A moment for the other workers to end by themselves once one has failed.

[Note: last words] torch elastic's agent stops every worker at the first monitor tick that
sees one fail (its process context's ``_poll`` closes the others with SIGTERM). A rank that
lost its peer is often a moment from saying so itself: gloo notices a closed connection in
about 0.04 s, then the rank raises an error that names the peer and the fix (a parameter
server's ``ServerLost``, a hang report) and exits. At a 0.1 s tick on a loaded machine the
SIGTERM can arrive first and those lines are never written: a parameter-server job whose
server was killed once ended with only the launcher's lines, the workers' ``ServerLost``
missing (``tests/test_parameter_server.py``, in a full run of the suite).

So before the agent's own look, a failed worker gives the ones still running up to
:data:`SETTLE_S` to end; the agent then stops whatever is left, as before. A rank that does not
notice (stopped, or busy outside a collective) costs the job that much more time to stop, once.

The ranks that end in that moment end in the same whole second as the one that failed first,
and torch names the earliest by that second, the lowest rank among equals: often a rank that
only lost its peer. So the first failure seen here is kept (:meth:`LastWords.first_failure`)
for the line that announces a restart.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

#: how long the others may take to end by themselves after a worker failed
SETTLE_S = 2.0

#: how often they are looked at meanwhile
_POLL_S = 0.02


def worker_handlers(agent: Any) -> dict[int, Any]:
    """The agent's subprocess handlers by local rank (each holds its worker's ``proc``); empty
    where this torch's agent has none ([Note: keeping survivors] in ``survivors.py``)."""
    handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None)
    return dict(handlers) if handlers else {}


@dataclass(frozen=True)
class Ended:
    """A worker that ended badly: its local rank, pid and status (negative: its signal)."""

    local_rank: int
    pid: int
    exitcode: int


class LastWords:
    """Gives the other workers their moment after a failure, and remembers the failure."""

    def __init__(self, timeout_s: float = SETTLE_S) -> None:
        self.timeout_s = timeout_s
        self._first: Ended | None = None

    def settle(self, agent: Any) -> bool:
        """Where one of ``agent``'s workers has ended with a non-zero status and others still
        run, wait until they have ended too, or the moment has passed. True if it waited."""
        handlers = worker_handlers(agent)
        procs = {lr: p for lr, h in handlers.items() if (p := getattr(h, "proc", None)) is not None}
        failed = [
            Ended(lr, p.pid, code)
            for lr, p in sorted(procs.items())
            if (code := p.poll()) is not None and code != 0
        ]
        if not failed:
            return False
        if self._first is None:
            self._first = failed[0]
        deadline = time.monotonic() + self.timeout_s
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return True

    def first_failure(self) -> Ended | None:
        """The first failure seen since the last call (then forgotten: each attempt has its
        own), or None."""
        first, self._first = self._first, None
        return first


__all__ = ["SETTLE_S", "Ended", "LastWords", "worker_handlers"]
