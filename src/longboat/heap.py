"""One malloc arena for a CPU (gloo) job: what gloo's threads free goes back to the shared heap.

[Note: one arena] glibc gives every thread that allocates its own arena (up to 8 per core) and
keeps what a thread frees in that thread's arena. gloo runs each collective on one of its
process group's worker threads, and its reduce-scatter stages a bucket-sized scratch buffer
there: at the end of a ZeRO-2 step of the reference GPT at 2 ranks, ``malloc_stats()`` showed
the main arena and two arenas of 27 MB each, almost all of it free, one per gloo thread, each
the size of a 25 MiB bucket. That memory stays resident and is of no use to the main thread.
With one arena (``mallopt(M_ARENA_MAX, 1)``) the scratch comes from the heap the rest of the
step uses and is reused by it: with ``MALLOC_ARENA_MAX=1`` the same runs peaked 30-80 MB lower
per rank (``benchmarks/malloc_retention.py`` measures it beside glibc's defaults).

It is set before the gloo process group (and its threads) is created, only when the data plane
is gloo: under NCCL the collectives' buffers live on the GPU and the gloo control plane moves a
few bytes. The limit does not end glibc's dynamic mmap threshold (only ``M_MMAP_THRESHOLD``,
``M_TRIM_THRESHOLD``, ``M_TOP_PAD`` and ``M_MMAP_MAX`` do). A user's own ``MALLOC_ARENA_MAX``
is left alone, so ``MALLOC_ARENA_MAX=8`` (or any value) restores glibc's choice. Set after
start-up, the limit binds threads that allocate afterwards, and only while glibc has made at most
8 arenas (it fixes its limit when it makes the 9th): ``longboat run`` gives each of several
workers one OpenMP thread, so few threads exist before ``initialize``; a process that ran many
threads before (a script started otherwise, with many intra-op threads) gets the same effect
from ``MALLOC_ARENA_MAX=1`` in its environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from typing import Any

M_ARENA_MAX = -8  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>
HUGE_PAGE = 2 * 1024 * 1024  # a transparent huge page on x86-64 and (4 KiB pages) arm64
#: Buffers from this size are worth the advice: at least one whole huge page inside them.
HUGE_MIN = 2 * HUGE_PAGE
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
ENV = "MALLOC_ARENA_MAX"
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's name for it in the environment
#: Where the threshold is fixed ([Note: fixed mmap threshold]).
MMAP_THRESHOLD = 4 * 1024 * 1024

_log = logging.getLogger("longboat")


def _mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl has mallopt but no arenas
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done: bool = mallopt(param, value) == 1  # restype c_int: an int
    return done


def fix_mmap_threshold(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Fix glibc's mmap threshold at 4 MiB in this process unless the user chose
    (``MALLOC_MMAP_THRESHOLD_``); True when it was set.

    [Note: fixed mmap threshold] glibc serves a block of at least its mmap threshold with a
    mapping of its own, given back to the system when freed; the threshold starts at 128 KiB
    and rises to the size of each larger mapped block freed (up to 32 MiB), after which blocks
    below it come from the heap, where memory freed stays resident. Disk offload
    ([Note: optimizer state offload] in ``strategies/zero/offload.py``) reads each unit's state
    into fresh tensors and frees them a unit later: under the dynamic threshold the freed
    buffers stayed in the heap, and the offloaded run's peak RSS equalled ZeRO-3 in memory's on
    the 272M-parameter GPT of ``benchmarks/offload_headline.py`` unless
    ``MALLOC_MMAP_THRESHOLD_=131072`` was set by hand. Fixing the threshold (``mallopt`` turns
    the dynamic adjustment off) gives each freed buffer back, so a disk home sets it as it is
    built; a user's own ``MALLOC_MMAP_THRESHOLD_`` is left alone.

    Fixed at 4 MiB, not at glibc's starting 128 KiB: the buffers of a unit's size (tens of MiB
    on models worth offloading) are still mappings given back, while the smaller temporaries of
    each operation (activations, autograd's gradients, the optimizer's per-parameter
    temporaries) are reused from the heap. At 128 KiB each of those was a mapping of its own,
    made, faulted in and unmapped again: ``mmap`` and ``munmap`` took a fifth of the main
    thread's samples in an offloaded step of an 84M-parameter GPT (``offload_headline.py
    --layers 6``: 2.02 s a step at 128 KiB, 1.70 s at 8 MiB, 1.63 s at 16 MiB). Higher keeps
    more freed memory in the heap: on the 272M-parameter GPT of ``offload_headline.py`` under a
    1,024 MiB budget, 8 MiB took rank 0 to 1,029 and 1,017 MiB in two runs (rank 1: 803), 4 MiB
    to 806 and 834, 2 MiB 797 and 796, with steps of 5.4-5.5, 5.9 and 5.8 s (8.0 s at 128 KiB
    without huge pages).

    The disk home's own unit-sized buffers no longer go back to the system after each use: they
    wait in its pool for the next ([Note: reused blocks] in ``strategies/zero/blocks.py``). The
    threshold stays fixed for everything else: with the pool, glibc's dynamic threshold took
    the 272M-parameter GPT's offloaded step from 4.2 to 3.6 s and its ranks to 1,379 and 1,622
    MiB, over the budget (a fixed 17 MiB: 1,296 and 1,314 MiB); the heap keeps what autograd's
    and the forward's temporaries free in its middle.
    """
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or MMAP_ENV in env:
        return False
    done = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    if done:
        _log.info(
            "malloc: mmap threshold fixed at %d KiB for offload, so buffers freed go back to the "
            "system (set %s to choose otherwise)",
            MMAP_THRESHOLD // 1024,
            MMAP_ENV,
        )
    return done


def limit_arenas(env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Allow glibc one malloc arena in this process unless the user chose (``MALLOC_ARENA_MAX``).

    Returns True when the limit was set; False where the user chose, the C library is not glibc,
    or the platform is not Linux. Threads that already own an arena keep it: call before
    starting the threads it is meant for. See [Note: one arena].
    """
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or ENV in env:
        return False
    done = _mallopt(M_ARENA_MAX, 1)
    if done:
        _log.debug("malloc: one arena for this gloo job (set %s to choose otherwise)", ENV)
    return done


# [Note: huge pages for unit buffers] ZeRO's unit-sized CPU buffers (a gathered unit, a gradient
# shard, a shard or optimizer state read from disk) are allocated for one use and freed after it;
# under the fixed mmap threshold each is a fresh mapping whose every 4 KiB page the kernel faults
# in and zeroes when the buffer is first written. Filling a fresh 25 MiB buffer took 10.5 ms here
# against 1.15 ms for one reused: at several GiB of such buffers a step, seconds. Asked for
# transparent huge pages (``madvise(MADV_HUGEPAGE)`` before the first write), the kernel faults
# the buffer in 2 MiB at a time: 2.5-3.7 ms. The memory is still given back when the buffer is
# freed, so the budget holds. Asked only where the kernel's mode is ``madvise`` (under
# ``always`` it does so unasked, under ``never`` not at all); the ends of a buffer that fall
# short of a whole huge page keep small pages.


def _thp_on_advice(path: str = THP_MODE) -> bool:
    """Whether the kernel's transparent huge pages are in ``madvise`` mode (``[madvise]``)."""
    try:
        with open(path) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


@functools.cache
def _madvise() -> Any:
    """The C library's ``madvise`` where the kernel gives huge pages on advice (asked once,
    at the first buffer), else None."""
    if not _thp_on_advice():
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask for transparent huge pages over the whole huge pages inside ``[address, address +
    nbytes)``, memory not written yet ([Note: huge pages for unit buffers]); True when asked.
    Nothing where the buffer is smaller than :data:`HUGE_MIN`, the kernel is not in ``madvise``
    mode, or the platform is not Linux."""
    if nbytes < HUGE_MIN or not sys.platform.startswith("linux"):
        return False
    madvise = _madvise()
    if madvise is None:
        return False
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    # A refusal (EINVAL on a kernel without THP) costs only the advice: the memory works as is.
    return end > start and madvise(start, end - start, MADV_HUGEPAGE) == 0
