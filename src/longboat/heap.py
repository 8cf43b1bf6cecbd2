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
import logging
import os
import sys

M_ARENA_MAX = -8  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
ENV = "MALLOC_ARENA_MAX"
MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's name for it in the environment
#: glibc's own default threshold, fixed ([Note: fixed mmap threshold]).
MMAP_THRESHOLD = 128 * 1024

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
    """Fix glibc's mmap threshold at 128 KiB in this process unless the user chose
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
