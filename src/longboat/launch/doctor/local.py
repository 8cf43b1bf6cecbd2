"""Checks about this machine alone: versions, backends, shared memory, the config's batch."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from longboat.launch.doctor.findings import Finding

GIB = 1024**3
# Below this, DataLoader workers and NCCL's shared-memory transport fail with bus errors.
MIN_SHM_BYTES = 1 * GIB


@dataclass(frozen=True)
class Backends:
    """Which process-group backends this machine can use."""

    gloo: bool
    nccl: bool
    mpi: bool
    cuda_devices: int


def versions() -> dict[str, str]:
    """The versions every rank must agree on."""
    import torch

    import longboat

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "longboat": getattr(longboat, "__version__", _dist_version()),
    }


def _dist_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("longboat")
    except PackageNotFoundError:
        return "unknown"


def backends() -> Backends:
    """Probe torch for the backends built in and the CUDA devices visible."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Backends(
        gloo=dist.is_gloo_available(),
        nccl=dist.is_nccl_available(),
        mpi=dist.is_mpi_available(),
        cuda_devices=cuda,
    )


def check_versions(found: dict[str, str]) -> Finding:
    return Finding("versions", "ok", ", ".join(f"{k} {v}" for k, v in found.items()))


def check_backend(wanted: str, have: Backends) -> Finding:
    """Is ``wanted`` (gloo, nccl or mpi) usable here?"""
    listing = (
        f"gloo {'yes' if have.gloo else 'no'}, nccl {'yes' if have.nccl else 'no'}, "
        f"mpi {'yes' if have.mpi else 'no'}, CUDA devices {have.cuda_devices}"
    )
    detail = f"{wanted} wanted; {listing}"
    if wanted == "gloo" and not have.gloo:
        return Finding(
            "backend",
            "fail",
            detail,
            "this torch build has no gloo; install a standard torch wheel",
        )
    if wanted == "nccl" and not have.nccl:
        return Finding(
            "backend",
            "fail",
            detail,
            "this torch build has no NCCL: install a CUDA build of torch, or use --backend gloo",
        )
    if wanted == "nccl" and have.cuda_devices == 0:
        return Finding(
            "backend",
            "fail",
            detail,
            "NCCL needs a CUDA device and none is visible: check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES, or use --backend gloo",
        )
    if wanted == "mpi" and not have.mpi:
        return Finding(
            "backend",
            "fail",
            detail,
            "this torch build has no MPI: build torch from source with MPI, or use --backend gloo",
        )
    return Finding("backend", "ok", detail)


def check_gpus_per_node(backend: str, nproc_per_node: int, have: Backends) -> Finding | None:
    """With NCCL each local rank needs its own GPU; None when it does not apply."""
    if backend != "nccl" or have.cuda_devices == 0 or nproc_per_node <= have.cuda_devices:
        return None
    return Finding(
        "gpus",
        "fail",
        f"-n {nproc_per_node} ranks on this node but {have.cuda_devices} CUDA device(s)",
        f"use -n {have.cuda_devices} or fewer with NCCL (one GPU per rank)",
    )


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """Size of the shared-memory filesystem, None when there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def check_shm(size: int | None) -> Finding:
    if size is None:
        return Finding(
            "shared memory",
            "warn",
            "/dev/shm is missing",
            "mount a tmpfs at /dev/shm (in docker: docker run --shm-size=8g ...)",
        )
    detail = f"/dev/shm {size / GIB:.1f} GiB"
    if size < MIN_SHM_BYTES:
        return Finding(
            "shared memory",
            "warn",
            detail + f" (under {MIN_SHM_BYTES // GIB} GiB)",
            "DataLoader workers and NCCL need more: in docker use "
            "`docker run --shm-size=8g ...` (or --ipc=host); in Kubernetes mount an "
            "emptyDir with medium: Memory at /dev/shm",
        )
    return Finding("shared memory", "ok", detail)


def check_config(path: Path | None, world_size: int) -> Finding | None:
    """The config loads and its batch triple resolves for ``world_size`` ranks."""
    if path is None:
        return None
    from longboat.config.batch import resolve_batch
    from longboat.config.errors import ConfigError
    from longboat.config.loading import load_config

    try:
        cfg = load_config(path)
        b = resolve_batch(cfg.batch, cfg.data_parallel_size(world_size))
    except ConfigError as e:
        msg = str(e)
        # The config's own messages say "...; <fix>": split them so the fix stands on its own.
        what, _, fix = msg.partition("; ")
        return Finding(
            "config",
            "fail",
            f"{path}: {what} (world size {world_size})",
            fix or "fix the config; `longboat config explain FILE` shows it resolved",
        )
    return Finding(
        "config",
        "ok",
        f"{path}: train_batch_size {b.train_batch_size} = micro "
        f"{b.micro_batch_size} x accumulation {b.gradient_accumulation_steps} x "
        f"{world_size} ranks; strategy {cfg.resolved_strategy(world_size)}",
    )
