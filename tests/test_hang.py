"""A rank that stops (SIGSTOP) is named, with its last collective, by the others within the
configured timeout plus 1 s; every process ends and the launcher prints the merged report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_launcher import SCRIPTS, _alive, _cli, _run

from longboat.comm.hang import build_report, format_report, is_hang_or_loss
from longboat.comm.trace import CallRecord

TIMEOUT_S = 3.0


@pytest.mark.parametrize("n", [2, 3])
def test_stopped_rank_is_named_with_its_last_collective(tmp_path: Path, n: int) -> None:
    logs = tmp_path / "logs"
    proc = _run(
        _cli(
            "run",
            "-n",
            str(n),
            "--log-dir",
            str(logs),
            str(SCRIPTS / "hang_sigstop.py"),
            str(TIMEOUT_S),
            str(tmp_path),
        )
    )
    err = proc.stderr
    out = proc.stdout + err
    stopped, survivors = n - 1, list(range(n - 1))
    assert proc.returncode != 0, err
    for r in survivors:
        entered = float((tmp_path / f"entered{r}").read_text())
        # Each survivor's own report, printed and written for the launcher.
        path = logs / "hang_reports" / f"rank{r}.json"
        rep = json.loads(path.read_text())
        assert rep["kind"] == "timeout" and rep["not_arrived"] == [stopped], rep
        assert rep["collective"]["op"] == "all_reduce" and rep["collective"]["shape"] == [1]
        assert rep["collective"]["source"] == f"hang_sigstop.py:{_line('WAIT HERE')} in <module>", (
            rep
        )
        # The stopped rank's last collective known here: the previous step's gradient bucket.
        last = rep["peer_last_known"]
        assert last["op"] == "all_reduce" and last["seq"] == rep["collective"]["seq"] - 1
        assert last["source"] == f"hang_sigstop.py:{_line('LAST AGREED')} in <module>", last
        # Survivors answered each other through the store; the stopped rank could not.
        assert sorted(rep["ranks"]) == [str(s) for s in survivors], rep["ranks"]
        # Detected within the timeout plus 1 s of entering the collective.
        assert path.stat().st_mtime - entered <= TIMEOUT_S + 1.0, path.stat().st_mtime - entered
        assert f"[rank{r}]: longboat: collective timed out after 3 s on rank {r} of {n}" in out
        assert f"[rank{r}]:   did not arrive: rank(s) {stopped} " in out, out
    # The launcher's merged report and its usual culprit line.
    names = ", ".join(map(str, survivors))
    assert f"longboat: collective timeout reported by rank(s) {names}" in err, err
    assert (
        f"longboat:   rank {stopped} did not arrive (named by rank(s) {names}); last "
        "collective all ranks agreed on: all_reduce(" in err
    ), err
    assert f"(where rank {stopped} called it is not known)" in err, err
    assert "failed with exit code 1" in err, err
    # Every process ended (the stopped rank too: SIGCONT follows the launcher's SIGTERM).
    time.sleep(0.2)
    for r in range(n):
        pid = int((tmp_path / f"pid{r}").read_text())
        assert not _alive(pid), f"rank {r} (pid {pid}) still runs"


def test_dead_rank_is_named_and_every_process_ends(tmp_path: Path) -> None:
    """A rank that dies is named by the launcher at once (the agent then stops the survivors,
    usually before they see the closed connection, so no hang report is required here)."""
    proc = _run(
        _cli("run", "-n", "2", str(SCRIPTS / "hang_sigstop.py"), "30", str(tmp_path), "exit")
    )
    err = proc.stderr
    assert proc.returncode == 3, err  # the dead rank's status
    assert "longboat: rank 1 failed with exit code 3" in err, err
    time.sleep(0.2)
    for r in (0, 1):
        assert not _alive(int((tmp_path / f"pid{r}").read_text())), f"rank {r} still runs"


def test_lost_peer_report_names_the_missing_rank() -> None:
    """The report a survivor builds from a closed connection (no store: a world of one here)."""
    rec = CallRecord(
        seq=5,
        op="all_reduce",
        dtype="float32",
        shape=(1,),
        out_shape=None,
        reduce_op="sum",
        group="default",
        source="t.py:9 in main",
        caller="",
    )
    err = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")
    assert is_hang_or_loss(err) and not is_hang_or_loss(RuntimeError("size mismatch"))
    rep = build_report(
        rank=0,
        world_size=3,
        namespace="x",
        current=rec,
        last_done=None,
        peer_last=rec,
        error=err,
        timeout_s=5,
    )
    assert rep["kind"] == "peer_lost" and rep["not_arrived"] == [1, 2], rep
    text = format_report(rep)
    assert text.startswith("longboat: a peer was lost during a collective on rank 0 of 3"), text
    assert "waiting in: all_reduce(float32[1]) #5 at t.py:9 in main" in text, text
    assert "did not arrive: rank(s) 1, 2" in text and "Connection closed by peer" in text, text


def test_a_rank_that_finished_is_not_placed_on_the_reporters_line() -> None:
    """Rank 0 runs a collective alone while rank 1 has already finished, its last collective
    called from another line than rank 0's (an equal all-reduce in another branch): the ranks
    agreed on the collective, not on the line, so neither rank 0's block nor the launcher's
    merged report may place rank 1 on rank 0's line."""
    from longboat.launch.hangs import merge

    def rec(seq: int, source: str) -> CallRecord:
        return CallRecord(
            seq=seq, op="all_reduce", dtype="float32", shape=(22,), out_shape=None,
            reduce_op="sum", group="default", source=source, caller="",
        )  # fmt: skip

    mine, agreed = rec(5, "alone.py:17 in <module>"), rec(4, "alone.py:11 in <module>")
    err = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:4242")
    rep = build_report(
        rank=0, world_size=2, namespace="x", current=mine, last_done=agreed, peer_last=agreed,
        error=err, timeout_s=3,
    )  # fmt: skip
    text = format_report(rep)
    assert (
        "did not arrive: rank(s) 1 (last collective all ranks agreed on: all_reduce(float32[22])"
        " #4 at alone.py:11 in <module>; the line is this rank's, theirs is not known)" in text
    ), text
    assert "rank 1: no answer within 0.5 s (stopped, dead, exited, or busy" in text, text
    lines = merge([rep])
    culprit = [ln for ln in lines if "rank 1 did not arrive" in ln]
    assert culprit == [
        "longboat:   rank 1 did not arrive (named by rank(s) 0); last collective all ranks "
        "agreed on: all_reduce(float32[22]) #4, called at alone.py:11 in <module> on rank 0 "
        "(where rank 1 called it is not known)"
    ], lines


def _line(marker: str) -> int:
    """The line of hang_sigstop.py that carries ``marker`` in its comment."""
    lines = (SCRIPTS / "hang_sigstop.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if f"# {marker}" in line)
