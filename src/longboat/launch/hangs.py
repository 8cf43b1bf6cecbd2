"""The launcher's side of hang reports: where workers write them, one merged report after a
failure, and waking stopped workers so that the stop signal can end them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_reports(directory: Path) -> list[dict[str, Any]]:
    """Every rank's report in ``directory`` (unreadable files skipped), by rank."""
    out = []
    for path in sorted(directory.glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text()))
    return sorted(out, key=lambda r: r.get("rank", 0))


def merge(reports: list[dict[str, Any]]) -> list[str]:
    """One report from the ranks' own: who did not arrive (and who says so), where each was."""
    if not reports:
        return []
    first = reports[0]
    world = int(first.get("world_size", 0))
    reporters = [r["rank"] for r in reports]
    kinds = {r["kind"] for r in reports}
    what = "collective timeout" if kinds == {"timeout"} else "lost peer / timeout"
    lines = [f"longboat: {what} reported by rank(s) {', '.join(map(str, reporters))}"]
    named: dict[int, list[int]] = {}
    for rep in reports:
        for r in rep.get("not_arrived", []):
            named.setdefault(r, []).append(rep["rank"])
    for r, by in sorted(named.items()):
        if r in reporters:
            continue
        # The ranks agree on a collective's kind, shape and number, not on the line that
        # called it: the line is the reporter's own, and the missing rank, stopped or gone,
        # cannot say which line it ran (it may have exited from another branch altogether).
        teller = next((rep for rep in reports if rep.get("peer_last_known")), None)
        last = (
            f"; last collective all ranks agreed on: {_agreed(teller['peer_last_known'])}, "
            f"called at {teller['peer_last_known']['source']} on rank {teller['rank']} "
            f"(where rank {r} called it is not known)"
            if teller is not None
            else ""
        )
        lines.append(
            f"longboat:   rank {r} did not arrive (named by rank(s) "
            f"{', '.join(map(str, by))}){last}"
        )
    for rep in reports:
        lines.append(f"longboat:   rank {rep['rank']} waited in {_sig(rep.get('collective'))}")
    silent = sorted(set(range(world)) - set(reporters) - set(named))
    if silent:
        lines.append(f"longboat:   rank(s) {', '.join(map(str, silent))} wrote no report")
    return lines


def _agreed(rec: dict[str, Any]) -> str:
    """``all_reduce(float32[20]) #4``: what every rank agreed on, without a line."""
    dims = ",".join(map(str, rec.get("shape", ())))
    return f"{rec['op']}({rec['dtype']}[{dims}]) #{rec['seq']}"


def _sig(rec: dict[str, Any] | None) -> str:
    if not rec:
        return "nothing"
    dims = ",".join(map(str, rec.get("shape", ())))
    return f"{rec['op']}({rec['dtype']}[{dims}]) #{rec['seq']} at {rec['source']}"


@contextlib.contextmanager
def report_dir(log_dir: Path) -> Iterator[Path]:
    """Tell workers (through the environment) where to write their reports."""
    from longboat.comm.hang import REPORT_DIR_VAR  # here: usage errors need no torch import

    path = log_dir / "hang_reports"
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("rank*.json"):
        old.unlink()
    saved = os.environ.get(REPORT_DIR_VAR)
    os.environ[REPORT_DIR_VAR] = str(path)
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop(REPORT_DIR_VAR, None)
        else:
            os.environ[REPORT_DIR_VAR] = saved


@contextlib.contextmanager
def wake_stopped_workers() -> Iterator[None]:
    """Follow every stop signal the agent sends a worker with SIGCONT.

    A worker stopped with SIGSTOP (a debugger, a frozen node) never acts on SIGTERM, so the
    agent would wait the whole grace period and then SIGKILL it; continued, it ends at once.
    torch's SubprocessHandler has no hook for this, hence the wrapper (restored afterwards).
    """
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as sh,
    )

    original = sh.SubprocessHandler.close

    def close(self: Any, death_sig: signal.Signals | None = None) -> None:
        original(self, death_sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    sh.SubprocessHandler.close = close  # type: ignore[method-assign]
    try:
        yield
    finally:
        sh.SubprocessHandler.close = original  # type: ignore[method-assign]
