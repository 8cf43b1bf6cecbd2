"""`longboat checkpoint consolidate` and `longboat checkpoint inspect`, through the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import ckpt_helpers as h
import pytest
import reference
import torch
from typer.testing import CliRunner

from longboat.cli import app


def _train_and_save(ckpt: str) -> dict:
    engine = h.build(h.config("zero3", 2))
    h.train(engine, 3, ckpt, save_at=(3,), noise=False)
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    engine.close()
    return state


@pytest.fixture(scope="module")
def sharded(ranks, tmp_path_factory):
    """A ZeRO-3 checkpoint written at 2 ranks (every parameter split between two files), and
    the full weights it holds."""
    d = tmp_path_factory.mktemp("zero3")
    state = ranks(2, _train_and_save, str(d))[0]
    return d, state


def test_consolidate_writes_weights_load_state_dict_accepts(sharded, tmp_path):
    ckpt, state = sharded
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(app, ["checkpoint", "consolidate", str(ckpt), str(out)])
    assert result.exit_code == 0, result.output
    # Read back with safetensors alone, in a process that never imports longboat.
    code = (
        "import sys; from safetensors.numpy import load_file; "
        "t = load_file(sys.argv[1]); print(sorted(t)); "
        "assert 'longboat' not in sys.modules"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    weights = load_file(out)
    model = reference.TinyNet()
    model.load_state_dict(weights)  # strict: every key, every shape
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_inspect_shows_the_checkpoint_and_verifies_it(sharded):
    ckpt, _ = sharded
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(ckpt)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "tag 'step-00000003', step 3, written by zero-3 at world size 2" in out
    assert "5 files" in out and "all match their SHA-256" in out
    assert "mid.weight     optim.exp_avg     [24, 24]  float32  2" in out, out


def test_inspect_flags_a_damaged_checkpoint(sharded, tmp_path):
    ckpt, _ = sharded
    copy = tmp_path / "t"
    copy.mkdir()
    for f in (ckpt / "step-00000003").iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    (copy / "rank-00001.safetensors").write_bytes(b"\0" * 64)
    result = CliRunner().invoke(app, ["checkpoint", "inspect", str(copy)])
    assert result.exit_code == 1
    assert "NOT VERIFIED" in result.output and "rank-00001.safetensors" in result.output
    result = CliRunner().invoke(
        app, ["checkpoint", "consolidate", str(copy), str(tmp_path / "o.safetensors")]
    )
    assert result.exit_code == 1 and not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "/no/such/dir"], "does not exist"),
        (["consolidate", "/no/such/dir", "o.safetensors"], "does not exist"),
        (["consolidate", "{ckpt}", "weights.bin"], "must end in .safetensors"),
        (["consolidate", "{ckpt}", "/no/such/dir/o.safetensors"], "output directory"),
        (["inspect", "{empty}"], "neither a checkpoint"),
    ],
)
def test_usage_errors_exit_2(sharded, tmp_path, args, message):
    ckpt, _ = sharded
    args = [a.format(ckpt=ckpt, empty=tmp_path) for a in args]
    result = CliRunner().invoke(app, ["checkpoint", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
