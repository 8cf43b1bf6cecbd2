"""`longboat bench` end to end on a tiny GPT: the outputs hold every side at every world size,
their derived figures follow from their own measurements, equivalent sides train identically,
and bad flags are usage errors. No timing is asserted: only what a run must compute."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from longboat.cli import app
from longboat.models import GPT, gpt_param_count

SIDES = ("replicate", "zero2", "pipeline", "tensor-parallel", "parameter_server", "ddp")
TWO_OR_MORE = ("pipeline", "tensor-parallel", "parameter_server")
SIZES = (1, 2)


def _exists(side: str, n: int) -> bool:
    return side not in TWO_OR_MORE or n > 1  # two stages, two tp ranks, a worker and a server


FIELDS = (
    "side",
    "world_size",
    "global_batch",
    "measured_steps",
    "step_time_median_s",
    "step_time_iqr_s",
    "step_time_min_s",
    "step_time_max_s",
    "samples_per_s",
    "speedup",
    "efficiency",
    "peak_rss_bytes_per_rank",
    "state_bytes_per_rank",
    "losses",
)
# tiny-gpt: vocabulary 128, d_model 32, 2 layers, positions 32, untied head.
TINY_PARAMS = gpt_param_count(vocab_size=128, d_model=32, n_layers=2, seq_len=32, tie_weights=False)
TINY_TENSORS = len(
    list(
        GPT(
            vocab_size=128, d_model=32, n_layers=2, n_heads=2, seq_len=32, tie_weights=False
        ).parameters()
    )
)


def _bench(out: Path, *flags: str) -> Any:
    return CliRunner().invoke(app, ["bench", "--out", str(out), *flags])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench")
    res = _bench(
        out,
        "--model",
        "tiny-gpt",
        "--strategies",
        "replicate,zero2,pipeline,tensor-parallel,parameter_server",
        "--peers",
        "ddp",
        "--world-sizes",
        "1,2",
        "--micro-batch",
        "4",
        "--seq-len",
        "16",
        "--warmup",
        "2",
        "--steps",
        "3",
    )
    assert res.exit_code == 0, res.output
    return out, json.loads((out / "bench.json").read_text())


def _row(result: dict[str, Any], side: str, n: int) -> dict[str, Any]:
    (row,) = [r for r in result["rows"] if r["side"] == side and r["world_size"] == n]
    return row


def test_json_has_every_side_and_world_size(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    assert sorted((r["side"], r["world_size"]) for r in result["rows"]) == sorted(
        (s, n) for s in SIDES for n in SIZES if _exists(s, n)
    )
    for r in result["rows"]:
        assert set(FIELDS) <= set(r), r["side"]
        assert r["measured_steps"] == 3 and len(r["step_times_s"]) == 3
        assert r["global_batch"] == 4 * r["world_size"]  # weak scaling: 4 per rank
        assert len(r["peak_rss_bytes_per_rank"]) == r["world_size"]
        assert all(b > 50 * 2**20 for b in r["peak_rss_bytes_per_rank"])  # torch alone is more
        assert len(r["losses"]) == 2 + 3
    assert result["unavailable"] == {}
    assert result["versions"]["torch"] and result["settings"]["scaling"] == "weak"
    assert "commit" in result["versions"]  # None outside a checkout
    # the machine named well enough to tell two 2-core machines apart
    assert result["machine"]["cpu_model"]
    assert result["machine"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_derived_figures_follow_from_the_json(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    for side in SIDES:
        for n in SIZES:
            if not _exists(side, n):
                continue
            r = _row(result, side, n)
            t = r["step_times_s"]
            assert r["step_time_median_s"] == statistics.median(t)
            assert (r["step_time_min_s"], r["step_time_max_s"]) == (min(t), max(t))
            assert r["samples_per_s"] == pytest.approx(r["global_batch"] / statistics.median(t))
            if _exists(side, 1):
                one = _row(result, side, 1)
                assert r["speedup"] == pytest.approx(r["samples_per_s"] / one["samples_per_s"])
                assert r["efficiency"] == pytest.approx(r["speedup"] / n)
            else:
                assert r["speedup"] is None and r["efficiency"] is None


def test_model_state_bytes_per_rank(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    a = TINY_PARAMS
    for n in SIZES:
        rep, ddp, z2 = (
            _row(result, s, n)["state_bytes_per_rank"] for s in ("replicate", "ddp", "zero2")
        )
        # Parameters + gradients + AdamW state, counted the same way; replicate's buckets also
        # hold one 4-byte usage flag per parameter ([Note: usage flags]).
        assert [r - d for r, d in zip(rep, ddp, strict=True)] == [4 * TINY_TENSORS] * len(rep)
        # Replicated: 4a + 4a + 8a, plus AdamW's 4-byte step counter per tensor.
        assert all(16 * a <= b <= 16 * a + 4 * 64 for b in rep)
        # ZeRO-2: 4a + 12a/n, plus step counters and shard padding (< n elements per unit).
        assert all(4 * a + 12 * a // n <= b <= 4 * a + 12 * a // n + 4 * 64 for b in z2), (n, z2)
    # Pipeline stages hold disjoint parts of the model: together, the whole model's state once;
    # apart, each less than all of it. With one data-parallel rank a stage trains as `single`,
    # whose gradients are freed at zero_grad, so its state is 4a + 8a, plus step counters.
    pipe = _row(result, "pipeline", 2)["state_bytes_per_rank"]
    assert 12 * a <= sum(pipe) <= 12 * a + 4 * 64, pipe
    assert all(b < 12 * a for b in pipe), pipe
    # Tensor parallelism divides the layers' weights and keeps norms and the position
    # embedding whole on both ranks: each rank less than the model, both together more.
    tp = _row(result, "tensor-parallel", 2)["state_bytes_per_rank"]
    assert all(b < 12 * a for b in tp) and sum(tp) > 12 * a, tp
    # A parameter server: the worker holds the parameters (its gradients are freed after the
    # push, its optimizer never steps); the server its values, AdamW's two moments and a step
    # counter per tensor (one server holds every tensor whole).
    worker, server = _row(result, "parameter_server", 2)["state_bytes_per_rank"]
    assert worker == 4 * a, worker
    assert server == 12 * a + 4 * TINY_TENSORS, server


def test_equivalent_sides_train_identically(run: tuple[Path, dict[str, Any]]) -> None:
    _, result = run
    for n in SIZES:
        ref = _row(result, "ddp", n)["losses"]
        assert ref[-1] != ref[0]  # the losses are real training losses, not a constant
        for side in ("replicate", "zero2", "pipeline", "tensor-parallel", "parameter_server"):
            if _exists(side, n):
                got = _row(result, side, n)["losses"]
                assert got == pytest.approx(ref, abs=1e-5), (side, n)
    assert set(result["max_abs_loss_diff"]) == {"1", "2"}
    assert max(result["max_abs_loss_diff"].values()) < 1e-5


def test_markdown_and_chart(run: tuple[Path, dict[str, Any]]) -> None:
    out, result = run
    md = (out / "bench.md").read_text()
    assert "| side | ranks | batch | median s |" in md
    for r in result["rows"]:
        assert (
            f"| {r['side']} | {r['world_size']} | {r['global_batch']} | "
            f"{r['step_time_median_s']:.4f} |" in md
        )
    assert result["versions"]["torch"] in md and '"micro_batch": 4' in md
    assert "![samples/s against world size](bench.png)" in md
    assert "Smoke run: 3 measured step(s)" in md  # fewer than 10 steps is flagged as such
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_strong_scaling_user_model_same_losses_at_every_world_size(tmp_path: Path) -> None:
    # Strong scaling splits one global batch over the ranks, so data-parallel training at 1 and
    # 2 ranks is the same computation; the model comes by import path, as a user's would.
    res = _bench(
        tmp_path,
        "--model",
        "longboat.bench.models:digits_cnn_spec",
        "--strategies",
        "replicate",
        "--peers",
        "",
        "--world-sizes",
        "1,2",
        "--micro-batch",
        "4",
        "--scaling",
        "strong",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--no-memory",
    )
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "bench.json").read_text())
    one, two = (_row(result, "replicate", n) for n in SIZES)
    assert one["global_batch"] == two["global_batch"] == 8
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert two["peak_rss_bytes_per_rank"] is None  # --no-memory


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--strategies", "zero4"], ["--strategies", "zero4", "zero3"]),
        (["--peers", "fsdp"], ["--peers", "'fsdp'", "fsdp2"]),
        (["--world-sizes", "0,2"], ["--world-sizes", "0,2"]),
        (["--world-sizes", "one"], ["--world-sizes", "one"]),
        (["--steps", "0"], ["--steps", "1 or more"]),
        (["--model", "no-such-model"], ["--model", "reference-gpt"]),
        (["--model", "no_such_pkg:spec"], ["--model", "no_such_pkg"]),
        (
            ["--scaling", "strong", "--world-sizes", "2,3,4", "--micro-batch", "1"],
            ["--scaling strong", "world size 3"],
        ),
        (
            ["--strategies", "pipeline", "--world-sizes", "2", "--pipeline-micro-batches", "3"],
            ["--pipeline-micro-batches 3", "global batch of 16", "world size 2"],
        ),
        (
            ["--strategies", "pipeline", "--world-sizes", "1,4", "--pipeline-micro-batches", "2"],
            ["--pipeline-micro-batches 2", "4 stages", "use 4 or more"],
        ),
        (
            ["--strategies", "parameter_server", "--world-sizes", "3", "--micro-batch", "1"],
            ["parameter_server", "2 workers", "global batch of 3"],
        ),
    ],
)
def test_bad_flags_exit_2(tmp_path: Path, flags: list[str], words: list[str]) -> None:
    res = _bench(tmp_path, "--model", "tiny-gpt", "--seq-len", "16", *flags)
    assert res.exit_code == 2, res.output
    for w in words:
        assert w in res.output, (w, res.output)
    assert not (tmp_path / "bench.json").exists()


def test_plan_spelling_of_a_stage_is_accepted() -> None:
    from longboat.bench.command import settings_from_flags

    s = settings_from_flags(
        model="tiny-gpt",
        strategies="replicate,zero-2,zero2",
        peers="",
        world_sizes="1",
        micro_batch=1,
        seq_len=16,
        warmup=1,
        steps=1,
        scaling="weak",
        threads=1,
        memory=False,
    )
    assert s.strategies == ("replicate", "zero2")


def _hide(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """Make ``package`` look not installed to importlib.util.find_spec."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )


def test_missing_peer_is_skipped_with_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hide(monkeypatch, "deepspeed")
    res = _bench(
        tmp_path,
        "--model",
        "tiny-gpt",
        "--seq-len",
        "16",
        "--strategies",
        "replicate",
        "--peers",
        "deepspeed",
        "--world-sizes",
        "1",
        "--micro-batch",
        "2",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--no-memory",
    )
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [r["side"] for r in result["rows"]] == ["replicate"]
    assert "not installed" in result["unavailable"]["deepspeed"]
    assert "- `deepspeed`: not installed" in (tmp_path / "bench.md").read_text()
    assert "deepspeed not run" in res.output


def test_missing_matplotlib_is_a_clear_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _hide(monkeypatch, "matplotlib")
    res = _bench(tmp_path, "--model", "tiny-gpt", "--seq-len", "16")
    assert res.exit_code == 2
    assert "pip install 'longboat[bench]'" in res.output


def test_config_sides_train_as_given_and_a_passed_deadline_stops_at_one_round() -> None:
    # `config:` sides (what longboat tune measures) train with the whole config given: 2
    # micro-batches of 2 per rank are the same step as replicate's one of 4. A deadline
    # already passed leaves every side one measured round and no memory launch.
    import time

    from longboat.bench.runner import BenchSettings, run_bench

    accumulated = {
        "strategy": "zero",
        "zero": {"stage": 2},
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 2},
    }
    s = BenchSettings(
        model="tiny-gpt",
        strategies=("replicate",),
        peers=(),
        world_sizes=(2,),
        micro_batch=4,
        seq_len=16,
        warmup=1,
        steps=4,
        configs={"config:zero-2 m2x2": accumulated},
        deadline=time.time() - 1,
    )
    result = run_bench(s)
    rows = {r["side"]: r for r in result["rows"]}
    assert set(rows) == {"replicate", "config:zero-2 m2x2"}
    assert rows["config:zero-2 m2x2"]["micro_batch"] == 2
    for r in rows.values():
        assert r["measured_steps"] == 1 and len(r["losses"]) == 2
        assert r["peak_rss_bytes_per_rank"] is None  # no memory launch after the deadline
    assert rows["config:zero-2 m2x2"]["losses"] == pytest.approx(
        rows["replicate"]["losses"], abs=1e-5
    )
