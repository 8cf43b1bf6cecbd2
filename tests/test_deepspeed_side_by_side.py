"""The same DeepSpeed scripts under real DeepSpeed 0.19.8 (torchrun, 2 ranks, gloo, CPU) and
under ``longboat run -n 2`` with ``import longboat.deepspeed as deepspeed``: loss by loss, lr by
lr, and across a save and a resume, at ZeRO stages 0 to 3 (stage 3 built under
``deepspeed.zero.Init`` and read through ``deepspeed.zero.GatheredParameters``;
tests/launch_scripts/ds_side_by_side.py holds the scripts).

Real DeepSpeed is looked for in ``.deepspeed/`` at the repository's root, where ``make test``
installs it (``make deepspeed-compare``; DeepSpeed alone, ``--no-deps``, so that it never brings
another torch: its light dependencies are the ``deepspeed-compare`` extra), or in the folder
``LONGBOAT_DEEPSPEED_PATH`` names. Only the DeepSpeed run has it on its ``PYTHONPATH``. Without
it these tests skip, saying how to install it. Each side runs once for the whole module; both
start together. DeepSpeed's CPU accelerator builds its shared-memory collective (used for
inference only) with the C++ compiler on its first run, where it finds one (cached in
``~/.cache/torch_extensions``); without a compiler it goes on without it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).parent / "launch_scripts" / "ds_side_by_side.py"
VERSION = "0.19.8"
TOL = 1e-5  # fp32; the two engines add the same gradients in a different order

pytestmark = pytest.mark.deepspeed_compare


def _deepspeed_home() -> Path | None:
    """The folder holding DeepSpeed VERSION (not imported here: that takes seconds)."""
    home = Path(os.environ.get("LONGBOAT_DEEPSPEED_PATH", ROOT / ".deepspeed"))
    found = (home / "deepspeed" / "__init__.py").is_file()
    return home if found and (home / f"deepspeed-{VERSION}.dist-info").is_dir() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen[str], name: str, out: Path) -> list[dict]:
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
        pytest.fail(f"{name} timed out:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{name} failed:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    home = _deepspeed_home()
    if home is None:
        pytest.skip(
            f"real DeepSpeed {VERSION} is not installed: `make deepspeed-compare` puts it in "
            ".deepspeed/ (or set LONGBOAT_DEEPSPEED_PATH to a folder made with `pip install "
            f"--no-deps --target DIR deepspeed=={VERSION}` and `pip install -e "
            "'.[deepspeed-compare]'`)"
        )
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ours = str(ROOT / "src")
    ds_out, lb_out = tmp_path_factory.mktemp("deepspeed"), tmp_path_factory.mktemp("longboat")
    ds_env = {
        **base,
        "DS_IMPL": "deepspeed",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join([str(home), ours]),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    ds = _start([*torchrun, "--master-port", str(_free_port()), str(SCRIPT), str(ds_out)], ds_env)
    lb_env = {**base, "PYTHONPATH": ours}
    lb = _start(
        [sys.executable, "-m", "longboat.cli", "run", "-n", "2", str(SCRIPT), str(lb_out)], lb_env
    )
    return {
        "deepspeed": _finish(ds, "DeepSpeed", ds_out),
        "longboat": _finish(lb, "longboat", lb_out),
    }


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    assert a == pytest.approx(b, rel=TOL, abs=TOL)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_loop_with_warmup_lr_gives_deepspeeds_losses_and_lrs(runs, stage):
    for rank in range(2):
        ds = runs["deepspeed"][rank][f"stage{stage}"]
        lb = runs["longboat"][rank][f"stage{stage}"]
        _close(lb["losses"], ds["losses"])
        assert [lr for (lr,) in lb["lrs"]] == pytest.approx([lr for (lr,) in ds["lrs"]])
        for key in ("global_steps", "stage", "batch", "boundaries", "samples"):
            assert lb[key] == ds[key], key
        for a, b in zip(lb["params"], ds["params"], strict=True):
            _close(a, b)
        # read through GatheredParameters on rank 0 only, before and after training
        weights = lb["weight_on_rank0"], ds["weight_on_rank0"]
        if rank == 0:
            for a, b in zip(*weights, strict=True):
                _close(a, b)
        else:
            assert weights == ([None, None], [None, None])
        if stage == 0:  # DeepSpeed reports no norm at stage 0; longboat the one it clipped by
            assert ds["norms"] == [None] * len(ds["norms"])
            ds = runs["deepspeed"][rank]["stage1"]
        assert (lb["norms"][0], ds["norms"][0]) == (None, None)  # before the first step
        _close(lb["norms"][1:], ds["norms"][1:])


@pytest.mark.parametrize("key", ["resume", "resume3"])
def test_save_and_resume_with_client_state_continue_as_deepspeed_does(runs, key):
    for rank in range(2):
        ds = runs["deepspeed"][rank][key]
        lb = runs["longboat"][rank][key]
        for side in (ds, lb):  # a resumed run is the uninterrupted one, in each framework
            # a fresh engine has no norm before its first step, in both
            norms = side["resumed"].pop("norms"), side["after"].pop("norms")
            assert norms[0][0] is None and norms[0][1:] == norms[1][1:]
            assert side["resumed"] == side["after"]
            assert side["params_resumed"] == side["params_after"]
            assert side["loaded"] and side["client"] == {"epoch": 3, "seen": 6}
        for part in ("before", "after"):
            _close(lb[part]["losses"], ds[part]["losses"])
            assert [lr for (lr,) in lb[part]["lrs"]] == pytest.approx(
                [lr for (lr,) in ds[part]["lrs"]]
            )
            assert lb[part]["global_steps"] == ds[part]["global_steps"]
        for a, b in zip(lb["params_after"], ds["params_after"], strict=True):
            _close(a, b)


def test_a_loop_on_comm_accelerator_and_repeating_loader_matches(runs):
    for rank in range(2):
        ds = runs["deepspeed"][rank]["comm"]
        lb = runs["longboat"][rank]["comm"]
        assert lb["device"] == ds["device"] == "cpu"
        assert lb["steps"] == ds["steps"] == 30
        _close(lb["mean_losses"], ds["mean_losses"])
