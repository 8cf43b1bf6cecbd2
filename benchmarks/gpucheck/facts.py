"""The machine and the versions a GPU check ran with, read without creating a CUDA context in
the parent (``nvidia-smi`` for the GPUs and the driver)."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.metadata
import os
import platform
import subprocess
from typing import Any

from gpucheck.launch import BENCHMARKS, REPO

PACKAGES = ("pydantic", "pydantic_core", "typing_extensions", "numpy", "transformers")


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> str | None:
    """What ``GPU_CHECK_COMMIT`` says, when set: a lent machine may be handed a snapshot of one
    commit inside another checkout, whose ``.git`` would name the wrong one. Else the checkout's
    commit, ``+dirty`` when tracked files changed."""
    given = os.environ.get("GPU_CHECK_COMMIT")
    if given:
        return given
    head = _run(["git", "rev-parse", "HEAD"])
    if head is None:
        return None
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return head + ("+dirty" if dirty else "")


def source_digest() -> str:
    """SHA-256 over longboat's sources and this check's, path by path: identifies the code that
    ran when no commit can be read."""
    h = hashlib.sha256()
    files = sorted((REPO / "src" / "longboat").rglob("*.py"))
    files += [*sorted(BENCHMARKS.glob("gpucheck/*.py")), BENCHMARKS / "gpu_check.py"]
    for path in files:
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus() -> list[dict[str, Any]]:
    """Each GPU's name, memory and driver, from ``nvidia-smi``; where it cannot say, the names
    from torch (which then initialises CUDA here); empty without a GPU."""
    out = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,driver_version",
            "--format=csv,noheader",
        ]
    )
    rows = []
    for line in (out or "").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4:
            index, name, memory, driver = fields
            rows.append({"index": index, "name": name, "memory": memory, "driver": driver})
    if rows:
        return rows
    import torch

    return [
        {"index": str(i), "name": torch.cuda.get_device_name(i), "memory": None, "driver": None}
        for i in range(torch.cuda.device_count())
    ]


def _nccl() -> str | None:
    import torch

    with contextlib.suppress(Exception):  # a CPU build of torch has no NCCL
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return None


def environment(dry: bool) -> dict[str, Any]:
    """What a results file records: date, GPUs and driver, Python, torch with its CUDA, cuDNN
    and NCCL, the packages longboat needs that a lent machine may lack, commit and digest."""
    import torch

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": dry,
        "gpus": [] if dry else gpus(),
        "cuda_device_count": 0 if dry else torch.cuda.device_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "nccl": _nccl(),
        "packages": {name: _version(name) for name in PACKAGES},
        "commit": commit(),
        "source_sha256": source_digest(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
