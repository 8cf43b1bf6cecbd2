"""Recovering runs, driven as a user would: `longboat run` in a subprocess (fault tests 1, 3 and
15 of RELIABILITY.md). Each launch costs seconds (the launcher and every worker import torch), so
the uninterrupted reference runs the script's training (ckpt_helpers) on the rank pool instead.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import ckpt_helpers as h
import pytest
import torch
from safetensors.torch import load_file

SCRIPTS = Path(__file__).parent / "launch_scripts"
TRAIN = SCRIPTS / "train_resume.py"
STEPS = 9
TIMEOUT_S = 120


def _launch(*args: str, **popen) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "longboat.cli", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **popen,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"launcher timed out\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def _weights_equal(a: Path, b: dict[str, torch.Tensor]) -> bool:
    x = load_file(a)
    return x.keys() == b.keys() and all(torch.equal(x[k], b[k]) for k in x)


@pytest.fixture(scope="module")
def uninterrupted(ranks) -> dict[str, torch.Tensor]:
    """What train_resume.py computes when nothing happens to it (same model, config, data)."""
    return ranks(2, h.run, "zero2", 2, STEPS, noise=False)[0]["state"]


def test_killed_rank_restarts_from_last_checkpoint_bit_exact(tmp_path, uninterrupted):
    """Fault test 1: rank 1 is SIGKILLed after step 5 (checkpoints every 2 steps); the launcher
    names it, restarts both workers, they resume from step 4 and end bit-identical."""
    t0 = time.monotonic()
    code, out, err = _finish(
        _launch(
            "-n",
            "2",
            "--max-restarts",
            "2",
            str(TRAIN),
            str(tmp_path / "ck"),
            str(tmp_path / "w"),
            str(STEPS),
            "--kill-at",
            "5",
        )
    )
    assert code == 0, err
    assert "longboat: rank 1 was killed by SIGKILL" in err
    assert "longboat: restarting all workers (attempt 2 of 3)" in err
    starts = sorted(re.findall(r"^\[rank\d\]: START attempt=(\d) step=(\d+) ", out, re.M))
    assert starts == [("0", "0"), ("0", "0"), ("1", "4"), ("1", "4")], out
    assert _weights_equal(tmp_path / "w", uninterrupted)
    print(f"fault 1: recovered in {time.monotonic() - t0:.1f} s, 1 step redone")


def test_rank_crashing_on_every_attempt_gives_up_after_k_plus_1(tmp_path):
    """Fault test 3: exactly max_restarts + 1 attempts, then a summary naming the rank and its
    exit code."""
    t0 = time.monotonic()
    code, _out, err = _finish(
        _launch("-n", "2", "--max-restarts", "2", str(SCRIPTS / "crash_always.py"), str(tmp_path))
    )
    assert code == 3, err
    assert sorted(os.listdir(tmp_path)) == [
        f"attempt{a}-rank{r}" for a in range(3) for r in range(2)
    ]
    assert "longboat: rank 1 failed with exit code 3" in err, err
    assert "longboat: giving up after 3 attempts" in err, err
    print(f"fault 3: gave up after 3 attempts in {time.monotonic() - t0:.1f} s")


def test_sigterm_to_the_launcher_writes_a_final_checkpoint(tmp_path, uninterrupted):
    """Fault test 15: SIGTERM to the launcher mid-run; every worker stops at the same step,
    writes a final checkpoint within the grace period and exits; resuming loses no step."""
    ck = tmp_path / "ck"
    proc = _launch(
        "-n",
        "2",
        "--grace-period",
        "30",
        str(TRAIN),
        str(ck),
        str(tmp_path / "w"),
        str(STEPS),
        "--sleep",
        "0.2",
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # wait until training runs
        lines.append(line)
        if "STEP 3" in line:
            break
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    code, out, err = _finish(proc)
    drain = time.monotonic() - t0
    out = "".join(lines) + out
    finals = re.findall(r"^\[rank(\d)\]: FINAL step=(\d+)", out, re.M)
    assert len(finals) == 2 and finals[0][1] == finals[1][1], out + err  # the same step
    stopped_at = int(finals[0][1])
    assert 3 <= stopped_at < STEPS
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err
    assert (ck / "latest").read_text().strip() == f"final-{stopped_at:08d}"
    assert drain < 30, f"drain took {drain:.1f} s, more than the grace period"
    # Resume: continues from the final checkpoint to the end, equal to the uninterrupted run.
    code, out, err = _finish(
        _launch("-n", "2", str(TRAIN), str(ck), str(tmp_path / "w"), str(STEPS))
    )
    assert code == 0, err
    assert f"START attempt=0 step={stopped_at} " in out
    assert _weights_equal(tmp_path / "w", uninterrupted)
    print(f"fault 15: drained in {drain:.1f} s at step {stopped_at}, 0 steps lost")
