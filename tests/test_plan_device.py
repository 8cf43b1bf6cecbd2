"""``longboat plan --device cuda``: the peaks count the cuBLAS workspaces a GPU rank holds
([Note: library workspaces] in ``longboat/plan/device.py``), sized as torch sizes them; on a GPU
(``pytest -m gpu``) the planned workspaces equal those a linear layer's forward and backward
make."""

from __future__ import annotations

import gc

import pytest
import torch
from typer.testing import CliRunner

from longboat.cli import app
from longboat.config import load_config
from longboat.plan import make_plan, resolve
from longboat.plan.device import cublas_workspace, cublaslt_workspace, workspaces

MIB = 2**20
GPT_ARGS = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16}


@pytest.mark.parametrize(
    ("major", "env", "expected"),
    [
        (9, {}, 32 * MIB),  # Hopper and later: torch's ":4096:8"
        (10, {}, 32 * MIB),
        (8, {}, 8 * MIB + 128 * 1024),  # before: ":4096:2:16:8"
        (8, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 32 * MIB),
        (9, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 128 * 1024),  # deterministic-mode setting
        (9, {"CUBLAS_WORKSPACE_CONFIG": "nonsense"}, 32 * MIB),
    ],
)
def test_a_cublas_workspace_is_sized_as_torch_sizes_it(major, env, expected):
    assert cublas_workspace(major, env) == expected


def test_cublaslt_workspace_is_a_mebibyte_unless_set():
    assert cublaslt_workspace({}) == MIB
    assert cublaslt_workspace({"CUBLASLT_WORKSPACE_SIZE": "4096"}) == 4 * MIB


def test_the_cpu_has_no_workspaces_and_cuda_two_threads_and_cublaslt():
    assert workspaces("cpu").bytes == 0
    spaces = workspaces("cuda", {"CUBLAS_WORKSPACE_CONFIG": ":4096:2"})
    assert spaces.bytes == 2 * 8 * MIB + MIB
    assert "forward and backward" in spaces.how


def _plan(device: str, budget: int | None = None):
    target = resolve("gpt", GPT_ARGS, seq_len=GPT_ARGS["seq_len"])
    cfg = load_config({"log": {"progress": False}, "zero": {"unit_classes": ["_Block"]}})
    names = ["single", "replicate", "zero-3"]
    return make_plan(target, cfg, 2, 2, "adamw", names, budget, device=device)


def test_a_cuda_plan_counts_the_workspaces_in_every_row():
    cpu, cuda = _plan("cpu"), _plan("cuda")
    extra = workspaces("cuda").bytes
    assert extra > 0
    for a, b in zip(cpu.strategies, cuda.strategies, strict=True):
        # and, on a GPU, the optimizer's multi-tensor temporaries (test_plan_host_offload.py)
        assert b.peak >= a.peak + extra and b.transient >= a.transient + extra
        assert b.model_state == a.model_state and b.activations == a.activations
        assert (a.workspaces, b.workspaces) == (0, extra)
    assert cuda.device == "cuda" and "cuBLAS" in cuda.workspaces
    # A budget between the two peaks fits on the CPU and not on a GPU.
    budget = max(s.peak for s in cpu.strategies) + extra // 2
    assert all(s.fits for s in _plan("cpu", budget).strategies)
    assert not any(s.fits for s in _plan("cuda", budget).strategies)


def test_the_command_line_plans_for_a_device_and_refuses_an_unknown_one(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    runner = CliRunner()
    base = ["plan", "--model", "gpt", "--model-args", '{"d_model": 32, "n_layers": 1}']
    result = runner.invoke(app, [*base, "--seq-len", "16", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    assert "on cuda: transient and peak include 65.0 MiB of cuBLAS workspaces" in result.output
    result = runner.invoke(app, [*base, "--seq-len", "16", "--device", "tpu"])
    assert result.exit_code == 2
    assert "--device 'tpu' is unknown" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_planned_workspaces_are_those_a_step_makes():
    device = torch.device("cuda")
    gc.collect()  # what earlier tests left to collect is not freed inside the measurement
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    layer = torch.nn.Linear(64, 64, device=device)
    layer(torch.randn(8, 64, device=device)).sum().backward()
    del layer
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before == workspaces("cuda").bytes
