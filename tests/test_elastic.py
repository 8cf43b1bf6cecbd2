"""An elastic node, ``longboat run -n MIN:MAX`` ([Note: elastic node] in launch/elastic.py), and
the other values ``-n`` takes (torchrun's ``gpu``, ``cpu``, ``auto``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import ckpt_helpers as h
import pytest
import torch
from safetensors.torch import load_file

from longboat.launch import nproc

SCRIPTS = Path(__file__).parent / "launch_scripts"


@pytest.mark.parametrize(
    ("value", "most", "least"),
    [("3", 3, 3), (2, 2, 2), ("2:4", 4, 2), ("3:3", 3, 3), (" 1:2 ", 2, 1)],
)
def test_numbers_and_ranges(value: str | int, most: int, least: int) -> None:
    got = nproc.parse(value)
    assert (got.most, got.least, got.elastic) == (most, least, least < most)


def test_cpu_and_auto_without_cuda_count_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = os.cpu_count() or 1
    assert nproc.parse("cpu") == nproc.Nproc(cores, cores)
    assert nproc.parse("auto") == nproc.Nproc(cores, cores)
    with pytest.raises(nproc.NprocError, match="-n/--nproc-per-node gpu: no CUDA device is"):
        nproc.parse("gpu")


def test_gpu_and_auto_count_the_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert nproc.parse("gpu") == nproc.Nproc(3, 3) == nproc.parse("AUTO")


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0", "'0': a node needs at least one worker process"),
        ("-1", "'-1': a node needs at least one worker process"),
        ("two", "'two' is not understood: give a number (-n 2), gpu, cpu, auto, or MIN:MAX"),
        ("4:2", "'4:2': MIN 4 is above MAX 2; write MIN:MAX, e.g. -n 2:4"),
        ("0:2", "'0:2': a node needs at least one worker process"),
        ("2:", "'2:' is not understood"),
    ],
)
def test_bad_values_are_named(value: str, says: str) -> None:
    with pytest.raises(nproc.NprocError) as e:
        nproc.parse(value)
    assert f"-n/--nproc-per-node {says}" in str(e.value)


def test_a_host_list_with_a_range_is_refused(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "longboat.cli", "run", "-n", "1:2", "-H", "localhost:2",
         str(SCRIPTS / "torchrun_allreduce.py")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "-n 1:2 with --hostfile/-H" in res.stderr


def test_a_failed_worker_restarts_the_node_one_smaller_resharded(tmp_path: Path, ranks) -> None:
    """``-n 2:3 --max-restarts 1``: 3 workers train ZeRO-2 with checkpoints every 2 steps; rank
    1 is SIGKILLed after step 5; the next attempt starts 2 workers, which resume from step 4's
    checkpoint resharded from 3 ranks to 2, and end bit-identical to a run of 2 ranks started
    from that same checkpoint (written by 3 ranks on the rank pool)."""
    steps = 9
    res = subprocess.run(
        [sys.executable, "-m", "longboat.cli", "run", "-n", "2:3", "--max-restarts", "1",
         str(SCRIPTS / "train_resume.py"), str(tmp_path / "ck"), str(tmp_path / "w"),
         str(steps), "--kill-at", "5"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "longboat: rank 1 was killed by SIGKILL" in res.stderr
    assert "the next attempt starts 2 workers instead of 3 (-n 2:3" in res.stderr, res.stderr
    starts = sorted(re.findall(r"^\[rank(\d)\]: START attempt=(\d) step=(\d+) ", res.stdout, re.M))
    assert starts == [
        ("0", "0", "0"), ("0", "1", "4"), ("1", "0", "0"), ("1", "1", "4"), ("2", "0", "0")
    ], res.stdout  # fmt: skip

    ref = str(tmp_path / "ref")
    ranks(3, h.run, "zero2", 3, 4, ckpt=ref, save_at=(4,), noise=False)
    resumed = ranks(2, h.run, "zero2", 2, steps, ckpt=ref, load=True, noise=False)[0]
    assert resumed["loaded_step"] == 4
    got = load_file(tmp_path / "w")
    want = resumed["state"]
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got), "not equal to the resharded resume"
