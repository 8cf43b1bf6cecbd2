"""Monitors: events reduced across ranks, written to CSV and TensorBoard and read back."""

from __future__ import annotations

import csv
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import reference
import torch
from torch import nn
from torch.utils.data import TensorDataset

import longboat
from longboat.config import ConfigError, load_config
from longboat.observe.events import StepEvent, count_tokens
from longboat.observe.tensorboard_sink import TensorBoardSink, tag

STEPS = 6


def _monitored(
    out: str, every: int = 1, tb: bool = True, steps: int = STEPS, accumulation: int = 1
) -> list[float]:
    """Train the reference model with CSV (and TensorBoard) monitors under ``out``; return this
    rank's loss per optimizer step as the engine saw it."""
    torch.manual_seed(0)
    model = reference.TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sink = {"enabled": True, "output_path": out, "job_name": "job"}
    engine = longboat.initialize(
        model,
        opt,
        {
            "log": {"progress": False, "level": "WARNING"},
            "batch": {"train_batch_size": 8, "gradient_accumulation_steps": accumulation},
            "monitor": {"every": every, "csv": sink, "tensorboard": {**sink, "enabled": tb}},
        },
    )
    loader = engine.loader(reference.dataset(8 * steps))
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for x, y in loader:
        engine.backward(loss_fn(engine(x), y))
        if engine.step():
            losses.append(engine.last_loss)
    engine.close()
    return losses


def _rows(out: Path) -> list[dict[str, str]]:
    with (out / "job" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_csv_rows_are_rank_means_and_match_one_process(ranks: Any, tmp_path: Path) -> None:
    per_rank = ranks(2, _monitored, str(tmp_path / "two"), 1, False)
    rows = _rows(tmp_path / "two")
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    # The mean over ranks of each rank's own loss, and the loss of the whole global batch.
    assert per_rank[0] != per_rank[1]
    for r, a, b in zip(rows, *per_rank, strict=True):
        assert float(r["loss"]) == pytest.approx((a + b) / 2, rel=1e-12)
    single = _monitored(str(tmp_path / "one"), tb=False)
    assert [float(r["loss"]) for r in rows] == pytest.approx(single, rel=1e-5)
    one = _rows(tmp_path / "one")
    assert [float(r["loss"]) for r in one] == single
    assert all(float(r["lr"]) == 0.2 for r in rows)
    assert all(r["loss_scale"] == "" and r["tokens_per_s"] == "" for r in rows)
    # samples/s is the global batch over the slowest rank's step time.
    for r in rows:
        assert float(r["samples_per_s"]) == pytest.approx(8 / (float(r["step_ms"]) / 1e3))


def test_every_and_accumulation(tmp_path: Path) -> None:
    losses = _monitored(str(tmp_path), every=2, tb=False, accumulation=2)
    rows = _rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    assert [float(r["loss"]) for r in rows] == [losses[1], losses[3], losses[5]]


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = _monitored(str(tmp_path), every=3)
    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "throughput/samples_per_s", "time/step_ms"} <= tags
    assert "train/loss_scale" not in tags and "throughput/tokens_per_s" not in tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [3, 6]
    assert [e.value for e in loss] == pytest.approx([losses[2], losses[5]], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([0.2, 0.2])
    rows = _rows(tmp_path)  # both sinks saw the same events
    assert [e.value for e in acc.Scalars("time/step_ms")] == pytest.approx(
        [float(r["step_ms"]) for r in rows], rel=1e-6
    )


def test_monitors_off_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model = reference.TinyNet()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {"log": {"progress": False}, "batch": {"micro_batch_size": 4}},
    )
    assert not engine.monitor.active and not engine.monitor.sinks
    for x, y in engine.loader(reference.dataset(16)):
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    engine.close()
    assert list(tmp_path.iterdir()) == []
    assert engine.monitor.step_times == []  # nothing was even timed


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


def test_tokens_per_second(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (24, 7))
    model = _Tokens()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            "log": {"progress": False},
            "batch": {"micro_batch_size": 4},
            "monitor": {"csv": {"enabled": True, "output_path": str(tmp_path)}},
        },
    )
    for (x,) in engine.loader(TensorDataset(ids)):
        logits = engine(x)
        engine.backward(nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()))
        engine.step()
    engine.close()
    rows = _rows_of(tmp_path / "longboat" / "metrics.csv")
    assert len(rows) == 6
    for r in rows:  # 4 sequences of 7 tokens per step
        assert float(r["tokens_per_s"]) == pytest.approx(7 * float(r["samples_per_s"]))


def _rows_of(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_count_tokens_rule() -> None:
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert count_tokens((ids,), {}) == 15
    assert count_tokens((torch.zeros(3, 5), torch.zeros(3, dtype=torch.long)), {}) == 0
    assert count_tokens((torch.zeros(3, 5),), {"input_ids": ids, "mask": ids}) == 15
    assert count_tokens((torch.zeros(3, 5, dtype=torch.bool),), {}) == 0


def test_fp16_loss_scale_in_events(tmp_path: Path) -> None:
    model = reference.TinyNet()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            "log": {"progress": False},
            "batch": {"micro_batch_size": 4},
            "precision": {"dtype": "fp16", "initial_scale_power": 8},
            "monitor": {"csv": {"enabled": True, "output_path": str(tmp_path)}},
        },
    )
    for x, y in engine.loader(reference.dataset(8)):
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    engine.close()
    rows = _rows_of(tmp_path / "longboat" / "metrics.csv")
    assert [float(r["loss_scale"]) for r in rows] == [256.0, 256.0]


def test_csv_refuses_a_file_with_other_columns(tmp_path: Path) -> None:
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "metrics.csv").write_text("step,something\n1,2\n")
    with pytest.raises(ValueError, match="job_name"):
        _monitored(str(tmp_path), tb=False)


def test_tensorboard_missing_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"longboat\[tensorboard\]"):
        TensorBoardSink(tmp_path)


def test_event_scalars_and_tags() -> None:
    e = StepEvent(
        step=3, loss=1.5, lr=0.1, step_ms=10.0, samples_per_s=800.0, phases_ms={"forward": 4.0}
    )
    assert e.scalars() == {
        "loss": 1.5,
        "lr": 0.1,
        "samples_per_s": 800.0,
        "step_ms": 10.0,
        "forward_ms": 4.0,
    }
    assert tag("loss") == "train/loss" and tag("forward_ms") == "time/forward_ms"


def test_deepspeed_blocks_map() -> None:
    cfg = load_config(
        {
            "train_batch_size": 8,
            "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "exp"},
            "csv_monitor": {"enabled": True, "output_path": "", "job_name": "exp2"},
            "wall_clock_breakdown": True,
            "flops_profiler": {"enabled": True},
        }
    )
    assert cfg.monitor.tensorboard.enabled and cfg.monitor.tensorboard.output_path == "tb"
    assert cfg.monitor.tensorboard.job_name == "exp"
    assert cfg.monitor.csv.enabled and cfg.monitor.csv.output_path == "runs"
    assert cfg.monitor.csv.job_name == "exp2"
    assert cfg.profile.wall_clock_breakdown and cfg.profile.flops
    with pytest.raises(ConfigError, match=r"flops_profiler\.profile_step"):
        load_config({"train_batch_size": 8, "flops_profiler": {"enabled": True, "profile_step": 3}})
    with pytest.raises(ConfigError, match=r"csv_monitor\.append"):
        load_config({"train_batch_size": 8, "csv_monitor": {"enabled": True, "append": 1}})


def test_monitor_config_refuses_unknown_keys() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'monitor.tensorboard'"):
        load_config({"monitor": {"tensorbord": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"did you mean 'profile.wall_clock_breakdown'"):
        load_config({"profile": {"wall_clock_breakdwn": True}})


def test_tensorboard_missing_is_refused_at_initialize(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    model = reference.TinyNet()
    with pytest.raises(ImportError, match="pip install 'longboat"):
        longboat.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            {
                "batch": {"micro_batch_size": 4},
                "monitor": {"tensorboard": {"enabled": True, "output_path": str(tmp_path)}},
            },
        )
    assert list(tmp_path.iterdir()) == []


def test_piped_console_lines_with_eta() -> None:
    import logging

    from longboat.observe.progress import ConsoleSink

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("longboat")
    log.addHandler(handler)
    old = log.level
    log.setLevel("INFO")
    try:
        sink = ConsoleSink(total=None, tty=False)
        event = StepEvent(
            step=50,
            loss=0.5,
            lr=1e-3,
            step_ms=100.0,
            samples_per_s=640.0,
            tokens_per_s=1280.0,
            loss_scale=1024.0,
        )
        sink.write(event)
        sink.total = 110
        sink.write(event)
        sink.close()
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    assert records == [
        "step 50  loss 0.5000  lr 0.001  scale 1024  640 samples/s  1,280 tokens/s  100.0 ms/step",
        "step 50/110  loss 0.5000  lr 0.001  scale 1024  640 samples/s  1,280 tokens/s  "
        "100.0 ms/step  ETA 0:00:06",
    ]


def test_piped_console_gets_an_event_every_50_steps() -> None:
    model = reference.TinyNet()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            "batch": {"micro_batch_size": 4},
            "monitor": {"every": 7, "total_steps": 99},
            "log": {"level": "WARNING"},
        },
    )
    if engine.monitor.sinks[0][0].tty:  # type: ignore[attr-defined]
        pytest.skip("stderr is a terminal: the bar takes every event")
    assert engine.monitor.console_every == 56  # the first multiple of 7 from 50
    engine.set_total_steps(120)
    assert engine.monitor.sinks[0][0].total == 120  # type: ignore[attr-defined]
    engine.close()


def test_wandb_offline_run_holds_the_events(tmp_path: Path) -> None:
    """A real (offline) W&B run: the .wandb file records each event's values under the same
    names as TensorBoard's. It is read as bytes: W&B's reader is not a public API, and the
    history's keys and JSON values are stored as plain strings."""
    torch.manual_seed(0)
    model = reference.TinyNet()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2),
        {
            "log": {"progress": False, "level": "WARNING"},
            "batch": {"train_batch_size": 8},
            "monitor": {
                "every": 2,
                "wandb": {"enabled": True, "output_path": str(tmp_path), "project": "p"},
            },
        },
    )
    losses = []
    for x, y in engine.loader(reference.dataset(8 * 4)):
        engine.backward(nn.CrossEntropyLoss()(engine(x), y))
        if engine.step():
            losses.append(engine.last_loss)
    engine.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # W&B's service process writes the file: run.finish() can return before its buffered
    # records reach it (seen once in a full suite: the header alone), so wait for them, bounded.
    wanted = [b"train/loss", b"throughput/samples_per_s", repr(losses[3]).encode()]
    deadline = time.monotonic() + 30
    data = run_file.read_bytes()
    while not all(w in data for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.1)
        data = run_file.read_bytes()
    assert b"train/loss" in data and b"throughput/samples_per_s" in data
    for logged in (losses[1], losses[3]):  # every 2 steps
        assert repr(logged).encode() in data, logged
    assert repr(losses[0]).encode() not in data


def test_wandb_missing_is_refused_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    model = reference.TinyNet()
    with pytest.raises(ImportError, match=r"longboat\[wandb\]"):
        longboat.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            {"batch": {"micro_batch_size": 4}, "monitor": {"wandb": {"enabled": True}}},
        )


def test_deepspeed_wandb_block_maps() -> None:
    cfg = load_config(
        {
            "train_batch_size": 8,
            "wandb": {"enabled": True, "team": "lab", "group": "g", "project": "proj"},
        }
    )
    w = cfg.monitor.wandb
    assert (w.enabled, w.entity, w.group, w.project, w.mode) == (
        True,
        "lab",
        "g",
        "proj",
        "offline",
    )


def test_a_step_does_not_read_the_loss_until_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the loss stays on the device]: backward and step leave the loss on the device
    (on a GPU a read after backward idles the device while the optimizer step is launched);
    last_loss reads it, once, and equals the mean of the step's micro-batch losses."""
    torch.manual_seed(0)
    model = reference.TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    engine = longboat.initialize(
        model,
        opt,
        {
            "log": {"progress": False, "level": "WARNING"},
            "batch": {"train_batch_size": 8, "gradient_accumulation_steps": 2},
        },
    )
    assert engine.last_loss is None  # before the first step
    reads: list[str] = []
    real_float, real_item = torch.Tensor.__float__, torch.Tensor.item

    def counted_float(t: torch.Tensor) -> float:
        reads.append("float")
        return real_float(t)

    def counted_item(t: torch.Tensor) -> Any:
        reads.append("item")
        return real_item(t)

    loss_fn = nn.CrossEntropyLoss()
    x, y = next(iter(torch.utils.data.DataLoader(reference.dataset(8), batch_size=8)))
    losses = []
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "__float__", counted_float)
        m.setattr(torch.Tensor, "item", counted_item)
        for half in (slice(0, 4), slice(4, 8)):
            loss = loss_fn(engine(x[half]), y[half])
            losses.append(loss.detach().clone())
            engine.backward(loss)
        assert engine.step()
        assert reads == []  # neither backward nor step waited for the loss
        got = engine.last_loss
        assert reads == ["float"]
        assert engine.last_loss == got and reads == ["float"]  # read once, then kept
    assert got == pytest.approx(float(sum(losses)) / 2, rel=1e-6)
    engine.close()
