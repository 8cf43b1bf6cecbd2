"""What a GPU rank holds beside the tensors the planner traces: the math libraries' workspaces.

[Note: library workspaces] cuBLAS works in a scratch buffer per handle and stream. torch
allocates it through its caching allocator the first time a thread runs a matrix product on a
stream, and keeps it for the life of the process, so ``torch.cuda.max_memory_allocated`` counts
it; the planner's trace runs on fake CPU tensors and never sees it. A training step multiplies
matrices on two threads: the forward on the caller's, the backward on autograd's own thread for
the device; each has its handle, hence two cuBLAS workspaces. The forward's linear layers with a
bias go through cuBLASLt (the bias added in the product's epilogue), whose workspace is one
more. Measured on an H200 (torch 2.11): at the peak of a one-rank step, the first linear layer
had made 33 MiB beyond its activations (32 + 1) and the backward 32 MiB.

Sizes, as torch chooses them: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs, KiB) when
set, else 32 MiB on compute capability 9 and above (``:4096:8``) and 8 MiB + 128 KiB below
(``:4096:2:16:8``); cuBLASLt's ``CUBLASLT_WORKSPACE_SIZE`` KiB, else 1 MiB. A plan made where no
GPU is present assumes capability 9, the larger. torch has changed these defaults between
releases; ``make gpu-check`` measures them beside the plan (``benchmarks/gpucheck/memory.py``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

#: Devices a plan can be made for: ``cpu`` adds nothing to the trace.
DEVICES = ("cpu", "cuda")
_KIB = 1024
_THREADS = 2  # the forward's and autograd's backward thread, each with its cuBLAS handle


@dataclass(frozen=True)
class Workspaces:
    """The library workspaces a rank holds on ``device``, in bytes, and how they were sized."""

    device: str
    bytes: int
    how: str


def cublas_workspace(capability_major: int, env: Mapping[str, str]) -> int:
    """Bytes of one cuBLAS workspace, as torch sizes it ([Note: library workspaces])."""
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * int(count) for size, count in pairs) * _KIB
    if capability_major >= 9:
        return 4096 * 8 * _KIB
    return (4096 * 2 + 16 * 8) * _KIB


def cublaslt_workspace(env: Mapping[str, str]) -> int:
    """Bytes of cuBLASLt's workspace (``CUBLASLT_WORKSPACE_SIZE`` KiB, else 1 MiB)."""
    given = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    return (int(given) if given.isdigit() else 1024) * _KIB


def _local_capability() -> tuple[int, str]:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return major, f"{torch.cuda.get_device_name()} (capability {major}.{minor})"
    return 9, "no GPU here: capability 9 assumed"


def workspaces(device: str, env: Mapping[str, str] | None = None) -> Workspaces:
    """The workspaces of a training rank on ``device`` ([Note: library workspaces])."""
    if device == "cpu":
        return Workspaces("cpu", 0, "")
    env = os.environ if env is None else env
    major, where = _local_capability()
    one, lt = cublas_workspace(major, env), cublaslt_workspace(env)
    mib = 2**20
    how = (
        f"cuBLAS workspaces: {_THREADS} x {one / mib:g} MiB (forward and backward threads) + "
        f"{lt / mib:g} MiB cuBLASLt, {where}"
    )
    return Workspaces(device, _THREADS * one + lt, how)


def default_device() -> str:
    """The device a run here would train on: ``cuda`` where torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"
