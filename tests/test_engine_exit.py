"""An engine the script never closes is closed at exit with no collective ([Note: leaving at
exit] in ``engine/core.py``)."""

from __future__ import annotations

from pathlib import Path

import harness

SCRIPTS = Path(__file__).parent / "launch_scripts"


def test_ranks_holding_different_engines_at_exit_leave_without_waiting() -> None:
    # Rank 1 drops the second of two ZeRO-3 engines, rank 0 keeps both; neither is closed.
    # Closed as close() does, rank 0's second engine gathers its parameters while rank 1
    # gathers the first's: each waits for the other until comm.timeout_s (20 s there), then
    # reports a collective timeout.
    out = harness.longboat_run("-n", "2", str(SCRIPTS / "exit_unclosed.py"), timeout=180)
    assert out.returncode == 0, out.stdout
    assert "DROPPED 0 False" in out.stdout and "DROPPED 1 True" in out.stdout, out.stdout
    assert "END 0" in out.stdout and "END 1" in out.stdout
    assert "timed out" not in out.stdout and "Traceback" not in out.stdout, out.stdout
