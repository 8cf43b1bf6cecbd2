"""``make gpu-check`` (benchmarks/gpu_check.py) kept from rotting on machines without a GPU: its
dry run (the same code paths on the CPU over gloo, tiny sizes) writes every part with the
expected keys and every equivalence case passes; its launcher records a task that raises, hangs
or kills its rank and goes on; its plain loops import nothing from longboat. Tests marked
``gpu`` run the same code on CUDA and are skipped, saying so, without it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from gpucheck import equivalence, memory, steptime  # noqa: E402
from gpucheck.launch import RankContext, Task, WorldSpec, run_world  # noqa: E402

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
)


# -- the launcher ------------------------------------------------------------------------------


def task_value(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    return {"value": args["value"], "rank": ctx.rank}


def task_raise(_args: dict[str, Any], _ctx: RankContext) -> None:
    raise ValueError("raised on purpose")


def task_hang(_args: dict[str, Any], _ctx: RankContext) -> None:
    time.sleep(600)


def task_die(_args: dict[str, Any], _ctx: RankContext) -> None:
    os._exit(3)


def test_a_failed_task_is_recorded_and_the_next_ones_run(tmp_path, monkeypatch):
    """A task that raises, one that hangs past its limit and one that kills its rank are each
    recorded with why, and the world restarts for the tasks after them."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    me = "test_gpu_check"
    tasks = [
        Task("raises", f"{me}:task_raise"),
        Task("after-raise", f"{me}:task_value", {"value": 1}),
        Task("hangs", f"{me}:task_hang", timeout_s=3.0),
        Task("dies", f"{me}:task_die"),
        Task("last", f"{me}:task_value", {"value": 2}),
    ]
    spec = WorldSpec("w", 1, "none", "cpu")
    recs = run_world(spec, tasks, time.monotonic() + 300, tmp_path, dry=True, grace_s=1.0)
    assert [r["status"] for r in recs] == ["error", "ok", "timeout", "error", "ok"]
    assert "ValueError: raised on purpose" in recs[0]["error"]
    assert "3 s limit" in recs[2]["error"]
    assert "task_hang" in recs[2]["logs"]["rank0"]  # where it hung: the stack it was asked for
    assert "exited with code 3" in recs[3]["error"]
    assert recs[1]["result"] == {"value": 1, "rank": 0} and recs[4]["result"]["value"] == 2


def test_a_failed_probe_skips_the_rest_of_its_world_and_the_deadline_skips_what_is_left(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    spec = WorldSpec("w", 1, "none", "cpu")
    gated = [Task("probe", "test_gpu_check:task_raise", gate=True), Task("rest", "x:y")]
    recs = run_world(spec, gated, time.monotonic() + 300, tmp_path, dry=True)
    assert [r["status"] for r in recs] == ["error", "skipped"]
    assert recs[1]["error"] == "skipped: probe failed"
    late = run_world(spec, [Task("t", "x:y")], time.monotonic() + 1, tmp_path, dry=True)
    assert late == [
        {"task": "t", "status": "skipped", "seconds": None, "error": "skipped: deadline"}
    ]


@pytest.mark.parametrize(
    ("gpus", "worlds", "unrunnable"),
    [
        (
            1,
            ["w1-nccl", "w2-gloo-cuda", "w4-gloo-cuda"],
            ["w2-nccl-one-gpu", "w2-nccl", "w4-nccl"],
        ),
        (2, ["w1-nccl", "w2-gloo-cuda", "w4-gloo-cuda", "w2-nccl"], ["w4-nccl"]),
        (8, ["w1-nccl", "w2-gloo-cuda", "w4-gloo-cuda", "w2-nccl", "w4-nccl"], []),
    ],
)
def test_the_worlds_follow_the_gpus_there_are(gpus, worlds, unrunnable):
    """NCCL at N ranks only with N GPUs (never two ranks on one GPU, which NCCL refuses); the
    gloo worlds always."""
    planned, skipped = equivalence.plan(gpus, dry=False)
    assert [w.name for w, _ in planned] == worlds
    assert [u["world"] for u in skipped] == unrunnable
    for spec, _tasks in planned:
        assert spec.device == "cuda" and spec.backend == spec.name.split("-")[1]
        assert spec.backend != "nccl" or not spec.share_gpu


def test_the_plain_loops_import_nothing_from_longboat():
    """As tests/reference.py (test_equivalence.py::test_reference_is_plain), the GPU check's
    plain side imports nothing from longboat."""
    tree = ast.parse((BENCHMARKS / "gpucheck" / "plain.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        assert all(n.split(".")[0] not in ("longboat", "gpucheck") for n in names), names


# -- the dry run -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    """``gpu_check.py --dry`` once for this module's tests; the folder it wrote."""
    out = tmp_path_factory.mktemp("gpu-check")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--dry", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def _read(out: Path, part: str) -> dict[str, Any]:
    return json.loads((out / f"{part}.json").read_text())


def test_the_dry_run_writes_every_part_with_the_machine_and_versions(dry_run):
    assert {p.name for p in dry_run.glob("*.json")} == {
        "equivalence.json",
        "memory.json",
        "step_time.json",
        "summary.json",
    }
    for part in ("equivalence", "memory", "step_time"):
        doc = _read(dry_run, part)
        assert {"environment", "config", "results", "summary", "wall_time_s"} <= doc.keys()
        env = doc["environment"]
        for key in ("date", "gpus", "python", "torch", "cuda", "nccl", "commit", "source_sha256"):
            assert key in env, key
        assert env["dry_run"] is True
    summary = json.loads((dry_run / "summary.json").read_text())
    assert summary["skipped_parts"] == {} and summary["lines"]


def test_every_equivalence_case_passes_in_the_dry_run(dry_run):
    doc = _read(dry_run, "equivalence")
    cases = doc["results"]
    bad = [(c["world"], c["case"], c.get("cause") or c.get("notes")) for c in cases]
    assert all(c["status"] == "pass" for c in cases), [
        b for b, c in zip(bad, cases, strict=True) if c["status"] != "pass"
    ]
    names = {(c["ranks"], c["case"]) for c in cases}
    # every data-parallel strategy at one rank; two ranks; hybrid, pipeline and tensor parallel
    for strategy in ("single", "replicate", "zero1", "zero2", "zero3"):
        assert (1, strategy) in names
    for case in ("replicate", "zero3", "pp2", "tp2"):
        assert (2, case) in names
    for case in ("hybrid-zero1", "hybrid-zero3", "pp2xzero2", "tp2xzero2"):
        assert (4, case) in names
    for c in cases:
        assert {"max_abs_loss_diff", "max_abs_param_diff", "max_rel_param_diff"} <= c.keys()
        assert c["parameter_devices"] == ["cpu"]
    assert doc["summary"]["pass"] == len(cases)


def test_the_dry_run_measures_memory_and_step_time_sides(dry_run):
    mem = _read(dry_run, "memory")["results"]
    assert set(mem["strategies"]) == set(memory.STRATEGIES + memory.BF16_PARAMS)
    for entry in mem["strategies"].values():
        assert entry["predicted_peak_bytes"] > 0
        assert entry["measured_peak_bytes"] is None  # no CUDA: not measured, and said so
    # On the CPU the state is there already: longboat takes 'cpu' as it is.
    assert mem["offload_optimizer_cpu"]["outcome"] == "trained"
    # The model built on the meta device trains with both offload keys (on the CPU, in place).
    beyond = mem["offload_beyond_the_gpu"]
    assert beyond["outcome"] == "trained" and beyond["home"] == "InMemory", beyond
    assert beyond["cap_bytes"] is None and beyond["peak_bytes_offload"] is None
    steps = _read(dry_run, "step_time")["results"]
    assert set(steps["eager"]["ratio_of_medians"]) == {
        "plain",
        "plain-read-loss",
        "single",
        "replicate",
        "zero-2",
        "zero-2+bf16",
    }
    # The profile of plain and single, kept so that a GPU run says where the time goes.
    assert set(steps["eager"]["profile"]) == {"plain", "single", "replicate", "zero-2"}
    assert "aten::" in steps["eager"]["profile"]["single"]["host_table"]
    assert steps["compiled"]["compile_backend"] == "eager"
    assert steps["compiled"]["ratio_of_medians"]["plain"] == 1.0
    assert set(steps["compiled"]["ratio_of_medians"]) == {"plain", "single", "single+compile"}


# -- on a GPU ----------------------------------------------------------------------------------


def _cuda() -> RankContext:
    return RankContext(0, 1, "cuda:0", "none", dry=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("strategy", list(equivalence.DP_STRATEGIES))
def test_one_rank_on_cuda_equals_the_plain_loop(strategy):
    task = equivalence._dp(strategy, 1)
    result = equivalence.train_dp(task.args, _cuda())
    outcome = equivalence.compare_dp(task.args, _cuda(), [result])
    assert outcome["parameter_devices"] == ["cuda:0"]
    assert outcome["passed"], outcome


@pytest.mark.gpu
@needs_cuda
def test_two_ranks_over_gloo_with_cuda_tensors_equal_the_plain_loop(tmp_path):
    spec = WorldSpec("w2-gloo-cuda", 2, "gloo", "cuda")
    tasks = [equivalence._dp(s, 2) for s in ("replicate", "zero2", "zero3")]
    recs = run_world(spec, tasks, time.monotonic() + 300, tmp_path, dry=False)
    records = [equivalence.case_record(spec, t, r) for t, r in zip(tasks, recs, strict=True)]
    assert all(r["status"] == "pass" for r in records), records


@pytest.mark.gpu
@needs_cuda
def test_memory_and_step_time_are_measured_on_cuda():
    args = dict(memory.DRY_TARGET, warmup=1, steps=1, strategy="zero-2")
    mem = memory.measure(args, _cuda())
    assert mem["measured_peak_bytes"] > 0 and mem["ratio_predicted_over_measured"] > 0
    offload = memory.offload_cpu(args, _cuda())
    assert offload["outcome"] == "trained" and offload["home"] == "OnHost"
    assert offload["optimizer_devices"] == ["cpu"] and offload["optimizer_pinned"]
    eager = steptime.tasks(dry=True)[0].args
    timed = steptime.measure(eager, _cuda())
    assert set(timed["median_s"]) == set(eager["sides"])


def test_the_peak_composition_replays_the_allocators_record():
    from gpucheck.allocations import composition

    def frame(path: str, line: int, name: str) -> dict:
        return {"filename": path, "line": line, "name": name}

    model = [frame("/x/models.py", 52, "forward")]
    linear = [frame("/y/torch/nn/modules/linear.py", 134, "forward"), *model]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": linear},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},  # autograd's thread
        {"action": "free_requested", "addr": 1, "size": 100, "frames": linear},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": linear},
        {"action": "alloc", "addr": 3, "size": 70, "frames": model},
        {"action": "alloc", "addr": 4, "size": 40, "frames": linear},  # the peak: 50+70+40
        {"action": "free_requested", "addr": 3, "size": 70, "frames": model},
        {"action": "alloc", "addr": 5, "size": 60, "frames": model},  # 50+40+60: below
    ]
    found = composition(trace)
    assert found["peak_bytes"] == 160
    assert found["live_at_peak"] == [
        {"where": "models.py:52 forward", "bytes": 70, "blocks": 1},
        {"where": "backward (no Python frame)", "bytes": 50, "blocks": 1},
        {"where": "models.py:52 forward <- linear.py:134 forward", "bytes": 40, "blocks": 1},
    ]
