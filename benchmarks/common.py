"""What every benchmark records and needs: a free loopback port, versions, the machine."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket

import torch


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def package_version(dist_name: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(*extra: str) -> dict[str, str | None]:
    """Python, torch, longboat and platform versions, plus those of ``extra`` distributions."""
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "longboat": package_version("longboat")}
    out.update({name: package_version(name) for name in extra})
    out["platform"] = platform.platform()
    return out


def machine() -> dict[str, object]:
    """The machine a result was measured on (no hostname)."""
    return {"cpu_count": os.cpu_count(), "processor": platform.processor(),
            "machine": platform.machine()}
