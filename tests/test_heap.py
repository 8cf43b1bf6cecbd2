"""glibc's malloc as longboat sets it ([Note: one arena] and [Note: fixed mmap threshold] in
heap.py), observed in fresh processes through glibc's own ``malloc_info``: how many heaps a thread
that allocates leaves behind, and whether a buffer is a mapping of its own; and the huge pages a
unit buffer asks for ([Note: huge pages for unit buffers]), observed in ``/proc/self/smaps``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc arenas are Linux's"
)

# What both scripts read glibc's state with: its own malloc_info, as XML.
_MALLOC_INFO = """
import ctypes, os, tempfile
_libc = ctypes.CDLL("libc.so.6")
_libc.fopen.restype = ctypes.c_void_p
_libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
_libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.fclose.argtypes = [ctypes.c_void_p]
def malloc_info():
    path = tempfile.mktemp()
    f = _libc.fopen(path.encode(), b"w"); _libc.malloc_info(0, f); _libc.fclose(f)
    info = open(path).read(); os.unlink(path)
    return info
"""

_SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import torch
    from longboat.heap import limit_arenas
    limited = limit_arenas() if sys.argv[1] == "limit" else None
    def work():  # a thread that allocates and frees, as gloo's workers do
        t = torch.empty(1 << 20); t.fill_(1.0); del t
    th = threading.Thread(target=work); th.start(); th.join()
    print(limited, malloc_info().count("<heap nr="))
    """
)


def _run(script: str, mode: str, **env: str) -> list[str]:
    """``script`` (after the malloc_info prelude) in a fresh process with no MALLOC_* variable
    but ``env``; what it printed, split."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return subprocess.run(
        [sys.executable, "-c", _MALLOC_INFO + script, mode],
        env={**clean, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()


def _heaps(mode: str, **env: str) -> tuple[str, int]:
    out = _run(_SCRIPT, mode, **env)
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


_MMAP_SCRIPT = textwrap.dedent(
    """
    import re, sys
    import torch
    from longboat.heap import fix_mmap_threshold
    fixed = fix_mmap_threshold() if sys.argv[1] == "fix" else None
    def mapped():  # bytes glibc holds in mappings of their own
        found = re.findall(r'<total type="mmap" count="\\d+" size="(\\d+)"/>', malloc_info())
        return int(found[-1])
    big = torch.empty(6 << 20); big.fill_(1.0); del big  # 24 MiB freed: the threshold rises
    before = mapped()
    kept = torch.empty(3 << 20); kept.fill_(1.0)  # 12 MiB: its own mapping, or the heap's
    print(fixed, mapped() - before >= (12 << 20))
    before = mapped()
    small = torch.empty(1 << 18); small.fill_(1.0)  # 1 MiB, an operation's temporary
    print(mapped() - before >= (1 << 20))
    """
)


def _kept_mapped(mode: str, **env: str) -> tuple[str, str]:
    out = _run(_MMAP_SCRIPT, mode, **env)
    return out[0], out[1]


def test_with_the_threshold_fixed_a_megabyte_comes_from_the_heap():
    # A temporary below the fixed threshold is reused from the heap, not mapped and unmapped.
    assert _run(_MMAP_SCRIPT, "fix")[2] == "False"


def test_after_a_large_free_glibc_serves_12_mib_from_the_heap():
    # The control: the dynamic threshold rose to 24 MiB, so 12 MiB is not a mapping of its own.
    assert _kept_mapped("none") == ("None", "False")


def test_with_the_threshold_fixed_12_mib_is_its_own_mapping():
    # ([Note: fixed mmap threshold]) and so goes back to the system when freed.
    assert _kept_mapped("fix") == ("True", "True")


def test_a_users_own_threshold_is_left_alone():
    assert _kept_mapped("fix", MALLOC_MMAP_THRESHOLD_="33554432") == ("False", "False")


def _offload_fixes_the_threshold(path: str) -> list[str]:
    import torch

    import longboat
    from longboat import heap

    calls: list[str] = []
    real = heap.fix_mmap_threshold
    heap.fix_mmap_threshold = lambda env=None: calls.append("fixed") or False  # type: ignore[assignment]
    try:
        for device in ("none", "disk"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            opt = torch.optim.AdamW(model.parameters())
            offload = {"device": device, "path": path} if device == "disk" else {}
            cfg = {"strategy": "zero", "zero": {"stage": 2, "offload_optimizer": offload}}
            longboat.initialize(model, opt, {**cfg, "batch": {"micro_batch_size": 2}}).close()
            calls.append(f"after {device}")
    finally:
        heap.fix_mmap_threshold = real
    return calls


def test_a_disk_home_fixes_the_threshold_as_it_is_built(ranks, tmp_path):
    assert ranks(1, _offload_fixes_the_threshold, str(tmp_path)) == [
        ["after none", "fixed", "after disk"]
    ]


def _huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings over ``t``'s memory, in KiB (the advice splits a mapping:
    its whole huge pages become a mapping of their own)."""
    storage = t.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    inside, size = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
            elif inside and head == "AnonHugePages:":
                size += int(line.split()[1])
    return size


def test_a_unit_buffer_asks_for_huge_pages_and_a_plain_one_does_not():
    from longboat import heap
    from longboat.strategies.zero.storage import empty

    mode = Path(heap.THP_MODE).read_text().strip() if os.path.exists(heap.THP_MODE) else "none"
    if "[madvise]" not in mode:
        pytest.skip(f"the kernel's transparent huge pages are {mode!r}, not on advice")
    n = 32 << 20  # 128 MiB of float32: a mapping of its own at any threshold
    plain = torch.empty(n)
    plain.fill_(1.0)
    unit = empty(n, torch.float32, "cpu")
    unit.fill_(1.0)
    assert _huge_kib(plain) == 0
    assert _huge_kib(unit) >= 2048 * 32, _huge_kib(unit)  # most of its 64 huge pages
