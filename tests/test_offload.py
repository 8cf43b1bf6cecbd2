"""ZeRO with its optimizer state offloaded to disk ([Note: optimizer state offload]): the plain
PyTorch loop of ``reference.py`` step for step, checkpoints to and from runs without offload,
the swap files' life, and the config (longboat's keys and DeepSpeed's)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import harness
import offload_helpers
import pytest
import reference
import torch

from longboat.config import ConfigError, load_config
from longboat.strategies.zero.offload import SWAP_DIR, check_room, remove_stale

SCRIPTS = Path(__file__).parent / "launch_scripts"
UNITS = {1: {"bucket_mb": 0.001}, 2: {"bucket_mb": 0.001}, 3: offload_helpers.ZOO_UNITS}


def _zero(stage: int, path: Path | None, buffer_count: int = 2) -> dict:
    zero: dict = {"stage": stage, **UNITS[stage]}
    if path is not None:
        zero["offload_optimizer"] = offload_helpers.disk(path, buffer_count)
    return {"strategy": "zero", "zero": zero}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_offloaded_zero_equals_plain_pytorch(ranks, tmp_path, stage, world):
    # AdamW (two moments per element on disk, its step count in memory), clipping and
    # accumulation; units of odd sizes; the zoo model has a routed (conditionally used), a
    # never-used and a frozen parameter, and BatchNorm buffers.
    recipe = reference.Recipe(model="zoo", optimizer="adamw", clip=0.5)
    strategy = _zero(stage, tmp_path, buffer_count=1 + stage % 2)
    offload_helpers.equals_plain_pytorch(ranks, world, strategy, recipe, tmp_path)


def _offloaded_run(cfg: dict, steps: int) -> dict:
    """Train ``steps`` steps; what the swap directory and the engine hold before close()."""
    engine = offload_helpers.train_zoo(cfg, steps)
    swap = engine.strategy.home.swap
    path = Path(cfg["zero"]["offload_optimizer"]["path"])
    out = {
        "files": sorted(f.name for f in offload_helpers.swap_files(path)),
        "disk_bytes": swap.disk_bytes,
        "in_memory": sum(
            t.numel() for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0
        ),
        "report": engine.memory_report().measured["optimizer_state"],
        "expected": engine.memory_report().expected["optimizer_state"],
        "moved": swap.moved,
        "pid": os.getpid(),
    }
    engine.close()
    return out


def test_state_lives_in_files_between_steps_and_they_go_at_close(ranks, tmp_path):
    cfg = {**harness.QUIET, **_zero(2, tmp_path), "batch": {"train_batch_size": 8}}
    got = ranks(2, _offloaded_run, cfg, 3)
    for rank, r in enumerate(got):
        # one file per unit, named by rank and process; nothing of AdamW's moments in memory
        mine = [f for f in r["files"] if f.startswith(f"rank{rank}.")]
        assert mine and all(f.startswith(f"rank{rank}.pid{r['pid']}.unit") for f in mine)
        assert r["in_memory"] == 0 and r["report"] == 0 and r["expected"] == 0
        # two moments of fp32 per element of this rank's shards, on disk
        assert r["disk_bytes"] > 0 and r["disk_bytes"] % 8 == 0
        # each of 3 steps reads (but the first) and writes every unit's state
        assert r["moved"] == (2 * 3 - 1) * r["disk_bytes"]
    assert not offload_helpers.swap_files(tmp_path)


def test_checkpoints_move_between_offloaded_and_in_memory_runs(ranks, tmp_path):
    offload_helpers.checkpoints_move(
        ranks, tmp_path, _zero(2, tmp_path / "a"), _zero(1, None), _zero(3, tmp_path / "b")
    )


def test_a_crashed_runs_files_are_removed_and_a_live_ones_kept(tmp_path):
    d = tmp_path / SWAP_DIR
    d.mkdir()
    dead, live = d / "rank0.pid999999999.unit0.bin", d / f"rank0.pid{os.getpid()}.unit0.bin"
    other = d / "notes.txt"
    for f in (dead, live, other):
        f.write_bytes(b"x")
    assert remove_stale(d) == [dead]
    assert not dead.exists() and live.exists() and other.exists()


def test_a_disk_too_small_is_refused_with_the_numbers(tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=3 * 2**20))
    with pytest.raises(ConfigError) as e:
        check_room(tmp_path / SWAP_DIR, 10 * 2**20)
    assert "10.0 MiB" in str(e.value) and "3.0 MiB free" in str(e.value)
    assert "zero.offload_optimizer.path" in str(e.value)
    check_room(tmp_path / SWAP_DIR, 2**20)  # enough room: no error


def test_a_path_that_is_not_a_writable_directory_is_refused(ranks, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    cfg = {**harness.QUIET, **_zero(2, not_a_dir), "batch": {"train_batch_size": 8}}
    with pytest.raises(Exception, match=r"zero.offload_optimizer.path = .* is a file, not a dir"):
        ranks(1, _offloaded_run, cfg, 1)


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_a_path_whose_parent_does_not_exist_is_refused_when_the_config_loads(tmp_path, key):
    """Before any rank builds anything ([Note: offload path]), in both dialects, by the key the
    user wrote; a path left unused (device none) is not looked at."""
    missing = tmp_path / "no-such-mount" / "swap"
    fix = f"create the parent first (mkdir -p {missing.parent})"
    native = {"strategy": "zero", "zero": {"stage": 3, key: {"device": "disk", "path": ""}}}
    native["zero"][key]["path"] = str(missing)
    with pytest.raises(ConfigError) as e:
        load_config(native)
    assert f"zero.{key}.path = {str(missing)!r}: its parent {str(missing.parent)!r} does not" in (
        str(e.value)
    )
    assert fix in str(e.value)
    ds = {"train_batch_size": 8, "zero_optimization": {"stage": 3, key: {"device": "nvme"}}}
    ds["zero_optimization"][key]["nvme_path"] = str(missing)
    with pytest.raises(ConfigError) as e:
        load_config(ds)
    assert f"DeepSpeed key 'zero_optimization.{key}.nvme_path' = {str(missing)!r}: its " in (
        str(e.value)
    )
    assert fix in str(e.value)
    assert not missing.parent.exists()  # nothing made
    native["zero"][key]["device"] = "none"
    load_config(native)
    # The last level alone is made later, by the swap: its parent exists.
    native["zero"][key] = {"device": "disk", "path": str(tmp_path / "swap")}
    assert load_config(native).zero.stage == 3


def _initialize_error(cfg: dict) -> str:
    """What ``longboat.initialize`` refuses on this rank ('' when it accepts)."""
    import longboat

    model, opt, _ = reference.Recipe(model="zoo", optimizer="adamw").build()
    try:
        longboat.initialize(model, opt, cfg).close()
    except ConfigError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_a_path_whose_parent_does_not_exist_is_refused_on_every_rank(ranks, tmp_path, key):
    # The path itself may be made; the directories above it never are: a mistyped mount
    # point would put the swap on the disk that holds "/".
    missing = tmp_path / "no-such-mount"
    disk = {"device": "disk", "path": str(missing / "swap")}
    cfg = {**harness.QUIET, "strategy": "zero", "zero": {"stage": 3, key: disk}}
    cfg["batch"] = {"train_batch_size": 8}
    errors = ranks(2, _initialize_error, cfg)
    for e in errors:
        assert f"zero.{key}.path = {str(missing / 'swap')!r}: its parent" in e, errors
        assert f"{str(missing)!r} does not exist" in e and "create the parent first" in e, e
    assert not missing.exists()
    # Its parent there, the path itself is made.
    disk["path"] = str(tmp_path / "swap")
    assert ranks(2, _initialize_error, cfg) == ["", ""]
    assert (tmp_path / "swap" / SWAP_DIR).is_dir()


def test_config_keys_and_deepspeeds(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("needs zero.offload_optimizer.path")):
        load_config({"strategy": "zero", "zero": {"offload_optimizer": {"device": "disk"}}})
    cfg = load_config(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {
                    "device": "nvme",
                    "nvme_path": str(tmp_path),
                    "buffer_count": 4,
                    "pin_memory": True,  # meaningful with an accelerator only
                },
            },
        }
    )
    off = cfg.zero.offload_optimizer
    assert (cfg.strategy, cfg.zero.stage) == ("zero", 3)
    assert (off.device, off.path, off.buffer_count) == ("disk", str(tmp_path), 4)
    with pytest.raises(ConfigError, match=re.escape("offload_optimizer.device' = 'tape'")):
        load_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "tape"}},
            }
        )
    with pytest.raises(ConfigError, match=re.escape("offload_optimizer.ratio")):
        load_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"ratio": 0.5}},
            }
        )


def test_a_crash_mid_step_resumes_from_the_last_checkpoint_and_no_swap_file_is_trusted(
    tmp_path,
):
    # ZeRO-3 at 2 ranks with parameters, gradients and optimizer state on disk, checkpoints
    # every 5 steps; rank 1 is SIGKILLed in step 8's optimizer step after half its units'
    # parameters and state were rewritten. The restarted job removes the dead
    # processes' swap files, resumes from step 5 and ends where a run without the crash ends.
    script = str(SCRIPTS / "offload_crash.py")
    whole = harness.longboat_run("-n", "2", script, str(tmp_path / "a"), str(tmp_path / "sa"))
    crashed = harness.longboat_run(
        "-n",
        "2",
        "--max-restarts",
        "1",
        script,
        str(tmp_path / "b"),
        str(tmp_path / "sb"),
        "--crash",
    )
    assert whole.returncode == 0, whole.stdout
    assert crashed.returncode == 0, crashed.stdout
    out = crashed.stdout
    assert "left by a process that no longer runs" in out, out
    assert "[rank0]: resumed at step 5" in out and "[rank1]: resumed at step 5" in out, out

    def digests(text: str) -> list[str]:
        return sorted(ln.split("]: ", 1)[1] for ln in text.splitlines() if "finished at step" in ln)

    assert digests(out) == digests(whole.stdout) and len(digests(out)) == 2, (out, whole.stdout)
    assert not offload_helpers.swap_files(tmp_path / "sb")


def _real_offloaded(cfg: dict) -> dict:
    """Two real steps of the plan tests' GPT with its state on disk: memory_report's bytes, the
    swap's, and the bytes the second step read and wrote."""
    from test_plan import GPT_ARGS, MICRO

    import longboat
    from longboat.models import GPT, gpt_loss, synthetic_tokens

    torch.manual_seed(0)
    net = GPT(**GPT_ARGS)
    engine = longboat.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-4), cfg)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        if step == 1:
            before = engine.strategy.offloaded["moved"]
        x, y = synthetic_tokens(MICRO, GPT_ARGS["seq_len"], GPT_ARGS["vocab_size"], g)
        engine.backward(gpt_loss(engine(x), y))
        engine.step()
    out = {"measured": engine.memory_report().measured, **engine.strategy.offloaded}
    out["step_moved"] = out["moved"] - before
    engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_the_plan_counts_what_stays_in_memory_and_what_goes_to_disk(ranks, tmp_path, stage):
    from test_plan import GPT_ARGS, MICRO, _config

    from longboat.plan import make_plan, resolve

    base = _config(f"zero-{stage}", "gpt", {})
    plan = make_plan(
        resolve("gpt", GPT_ARGS), load_config(base), 2, MICRO, "adamw", [f"zero-{stage}+offload"]
    )
    row = plan.strategies[0]
    disk = {"device": "disk", "path": str(tmp_path)}
    zero = {**base["zero"], "offload_optimizer": disk}
    if stage == 3:  # zero-3+offload: parameters and gradients on disk too
        zero["offload_param"] = disk
    for r, real in enumerate(ranks(2, _real_offloaded, {**base, "zero": zero})):
        if r == 0:  # the plan's figures are rank 0's
            assert row.model_state == real["measured"]
            assert row.model_state["optimizer_state"] == 0
            assert row.disk == real["disk"] > 0
            # a step (the second) reads and writes what the plan's does
            assert row.disk_moved == real["step_moved"] > 0
            if stage == 1:  # the state alone: read once and written once
                assert real["step_moved"] == 2 * real["disk"]
            else:  # nothing of the model state stays in memory
                assert sum(row.model_state.values()) == 0


def test_plan_recommends_offload_when_nothing_else_fits():
    from typer.testing import CliRunner

    from longboat.cli import app

    args = ["plan", "--model", "gpt", "--model-args", '{"d_model": 64, "n_layers": 2}']
    args += ["--world-size", "2", "--json"]
    import json

    full = json.loads(CliRunner().invoke(app, args).output)
    peaks = {s["strategy"]: s["peak"] for s in full["strategies"]}
    budget = min(peaks.values()) - 1  # nothing of the default strategies fits
    res = CliRunner().invoke(app, [*args, "--budget", str(budget)])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    rows = {s["strategy"]: s for s in got["strategies"]}
    assert got["recommended"].endswith("+offload"), got["recommended"]
    rec = rows[got["recommended"]]
    assert rec["fits"] and rec["disk"] > 0 and rec["model_state"]["optimizer_state"] == 0
    assert not any(rows[s]["fits"] for s in peaks)
