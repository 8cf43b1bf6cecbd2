"""Turn the failures torch elastic reports into one clear line and an exit code.

torch's ``ChildFailedError`` lists every worker that ended badly, including the ones the agent
itself stopped with SIGTERM after the first failure and the ones that died only because a peer
went away. Its "root cause" is the earliest *whole-second* timestamp, so when two ranks are seen
in the same monitor tick it simply names the lowest rank, often the victim. Here the root cause is
chosen by what each rank's exit says, and only then by time.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass

# Words gloo (and the store) use when the *other* end went away: a rank whose stderr ends with
# one of these most likely died of someone else's failure.
_PEER_LOSS_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Connection refused",
    "DistNetworkError",
)


@dataclass(frozen=True)
class WorkerExit:
    """How one worker ended: its global rank, pid, exit code (negative: killed by that signal)."""

    rank: int
    pid: int
    exitcode: int
    timestamp: int = 0
    stderr_tail: str = ""

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` etc. when a signal ended the process, else ``None``."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def shell_code(self) -> int:
        """The exit status a shell would show: the code, or 128 + signal number."""
        return 128 - self.exitcode if self.exitcode < 0 else self.exitcode

    @property
    def lost_a_peer(self) -> bool:
        """True when its last output says a connection to another rank was lost."""
        return any(marker in self.stderr_tail for marker in _PEER_LOSS_MARKERS)


@dataclass(frozen=True)
class FailureReport:
    """What the launcher prints (``lines``) and the status it exits with (``exit_code``)."""

    root: WorkerExit
    lines: tuple[str, ...]
    exit_code: int


def describe(worker: WorkerExit) -> str:
    """One line naming the rank and how it ended."""
    if worker.signal_name is not None:
        return f"longboat: rank {worker.rank} was killed by {worker.signal_name}"
    return (
        f"longboat: rank {worker.rank} failed with exit code {worker.exitcode} "
        "(see its traceback above)"
    )


def _ranks(workers: Iterable[WorkerExit]) -> str:
    ranks = sorted(w.rank for w in workers)
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(map(str, ranks))}"


def summarize(workers: Iterable[WorkerExit], stop_signal: int = signal.SIGTERM) -> FailureReport:
    """Pick the root cause among failed workers and word the report.

    Order of suspicion: a rank the agent did not stop itself (its exit is not ``stop_signal``);
    then one that did not merely lose a peer; then a signal death (nothing in a job sends
    SIGKILL/SIGSEGV as a consequence of another rank failing) over an exit code; then the earliest
    timestamp; then the lowest rank.
    """
    failed = list(workers)
    if not failed:
        raise ValueError("summarize() needs at least one failed worker")

    def suspicion(w: WorkerExit) -> tuple[bool, bool, bool, int, int]:
        return (
            w.exitcode == -stop_signal,
            w.lost_a_peer,
            w.signal_name is None,
            w.timestamp,
            w.rank,
        )

    root = min(failed, key=suspicion)
    lines = [describe(root)]
    if root.lost_a_peer:
        # Every failure seen here is a consequence: the culprit is not among them.
        lines.append(
            f"longboat: rank {root.rank} had lost its connection to another rank, which is not "
            "among these failures: it may run on another node, or have exited early with status 0"
        )
    stopped = [w for w in failed if w is not root and w.exitcode == -stop_signal]
    followers = [w for w in failed if w is not root and w.exitcode != -stop_signal]
    if followers:
        lost = [w for w in followers if w.lost_a_peer]
        other = [w for w in followers if not w.lost_a_peer]
        if lost:
            lines.append(f"longboat: {_ranks(lost)} then failed after losing a peer")
        lines.extend(describe(w).replace("longboat: ", "longboat: also: ", 1) for w in other)
    if stopped:
        name = signal.Signals(stop_signal).name
        lines.append(f"longboat: {_ranks(stopped)} stopped by the launcher ({name})")
    return FailureReport(root=root, lines=tuple(lines), exit_code=root.shell_code)
