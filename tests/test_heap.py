"""One malloc arena for gloo jobs ([Note: one arena] in heap.py), observed in fresh processes
through glibc's own ``malloc_info``: how many heaps a thread that allocates leaves behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc arenas are Linux's"
)

_SCRIPT = textwrap.dedent(
    """
    import ctypes, os, sys, tempfile, threading
    import torch
    from longboat.heap import limit_arenas
    limited = limit_arenas() if sys.argv[1] == "limit" else None
    def work():  # a thread that allocates and frees, as gloo's workers do
        t = torch.empty(1 << 20); t.fill_(1.0); del t
    th = threading.Thread(target=work); th.start(); th.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    path = tempfile.mktemp()
    f = libc.fopen(path.encode(), b"w"); libc.malloc_info(0, f); libc.fclose(f)
    info = open(path).read(); os.unlink(path)
    print(limited, info.count("<heap nr="))
    """
)


def _heaps(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode],
        env={**clean, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    return out[0], int(out[1])


def test_a_thread_gets_its_own_arena_without_the_limit():
    # The control: without it, the thread's frees stay in a heap of its own.
    assert _heaps("none") == ("None", 2)


def test_with_the_limit_a_thread_allocates_from_the_one_arena():
    assert _heaps("limit") == ("True", 1)


def test_a_users_own_setting_is_left_alone():
    assert _heaps("limit", MALLOC_ARENA_MAX="4") == ("False", 2)


def test_joining_a_gloo_group_sets_the_limit_first_and_an_nccl_one_does_not(monkeypatch):
    import longboat.world as world_mod

    calls: list[str] = []
    monkeypatch.setattr(world_mod, "limit_arenas", lambda: calls.append("limit"))
    monkeypatch.setattr(
        world_mod.dist, "init_process_group", lambda **kw: calls.append(kw["backend"])
    )
    monkeypatch.setattr(world_mod.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(world_mod.torch.cuda, "set_device", lambda d: None)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    two = world_mod.World(rank=0, world_size=2, local_world_size=2)
    world_mod.init_process_group(two, backend="gloo")
    world_mod.init_process_group(two, backend="nccl")
    assert calls == ["limit", "gloo", "nccl"]
