"""The default example end to end: two processes under the launcher, and a plain process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _accuracy(out: str) -> float:
    m = re.search(r"accuracy=([0-9.]+)", out)
    assert m, f"no accuracy line in output:\n{out[-3000:]}"
    return float(m.group(1))


def _two_ranks(script: str, *args: str) -> str:
    """``longboat run -n 2 examples/<script> <args>``; its output, after checking it succeeded."""
    cmd = [sys.executable, "-m", "longboat.cli", "run", "-n", "2", str(ROOT / "examples" / script)]
    proc = subprocess.run(
        [*cmd, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize(
    ("config", "strategy"), [(None, "replicate"), ("digits_zero3.toml", "zero-3")]
)
def test_digits_under_longboat_run_two_ranks(config, strategy):
    extra = ["--config", str(ROOT / "examples" / config)] if config else []
    out = _two_ranks("digits.py", *extra)
    assert f"strategy {strategy} on 2 rank(s)" in out
    assert _accuracy(out) >= 0.95
    assert out.count("accuracy=") == 1, "only rank 0 prints the result"


def test_digits_as_a_plain_script():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "strategy single on 1 rank(s)" in out
    assert _accuracy(out) >= 0.95


def _gpt(config: str) -> tuple[float, str]:
    out = _two_ranks("gpt.py", "--config", str(ROOT / "examples" / config), "--steps", "3")
    m = re.search(r"steps=3 final_loss=([0-9.]+)", out)
    assert m, f"no final_loss line in output:\n{out[-3000:]}"
    assert out.count("final_loss=") == 1, "only rank 0 prints the result"
    return float(m.group(1)), out


def test_gpt_in_two_pipeline_stages_by_config_only():
    # The same script and samples: data parallel over 2 ranks, then 2 pipeline stages.
    dp_loss, dp_out = _gpt("gpt.toml")
    pp_loss, pp_out = _gpt("gpt_pp2.toml")
    assert "strategy replicate on 2 rank(s)" in dp_out
    assert "mesh pp 2 x dp 1 x tp 1" in pp_out
    # Split by measured layer time (the config leaves the partition unset): where the cut falls
    # depends on this machine's timings, so only its shape is checked: two contiguous stages of
    # the 6 layers (embeddings, 4 blocks, norm and head), each with its measured time.
    stages = re.findall(r"pipeline stage (\d): layers (\d)-(\d) \(.*measured", pp_out)
    assert len(stages) == 2, pp_out
    (s0, a0, b0), (s1, a1, b1) = stages
    assert (s0, a0, s1, b1) == ("0", "0", "1", "5") and int(a1) == int(b0) + 1, stages
    assert pp_loss == pytest.approx(dp_loss, rel=1e-4)
