"""A bounded pool of large CPU blocks under torch's allocator, for runs whose mmap threshold is
fixed.

[Note: warm blocks] Disk offload fixes glibc's mmap threshold ([Note: fixed mmap threshold] in
``heap.py``) so that what it frees goes back to the system and the run keeps its budget. The
price is paid by every other large temporary: each gradient autograd makes for a large weight
(16 MiB for an MLP matrix of ``benchmarks/offload_headline.py``'s model) becomes a fresh
mapping the kernel faults in and zeroes, 5.4 ms against 0.8 ms from a warm heap, measured
(``docs/memory.md``); on that model it was most of the offloaded step's gap to ZeRO-3 in memory.
Letting glibc's heap keep such blocks went over the budget: its free blocks split and merge, and
the backward's peak rose by up to 50%.

So torch's CPU allocator is given a pool of its own for blocks of at least the threshold: a
freed block is kept while the pool holds at most ``cap`` bytes (the largest kept blocks make
room for a newer one), and an allocation takes the smallest kept block of at least its size and
at most a quarter more, or a fresh mapping. Smaller blocks are torch's default allocator's, as
before. The disk home sets ``cap`` to two of the model's largest parameter: a backward's
gradients are the temporaries it makes most often at that size, one landing while the one before
is reduced. What the pool keeps counts against the budget, never more than ``cap``; the planner
does not count it. On the headline model (largest parameter 32 MiB) a cap of 64 MiB measured
1.15-1.19x ZeRO-3 in memory at 938-1,010 MiB per rank in two runs, 128 MiB 1.13-1.16x at
971-995 MiB in one, against 1.31-1.32x at 913-936 MiB without the pool (``docs/memory.md``).

torch has no Python hook for its CPU allocator, only C++'s ``c10::SetCPUAllocator``, so the pool
is a small C++ extension built with ``torch.utils.cpp_extension`` where it is first needed (a
C++ compiler and ``ninja`` are needed once per torch version; the build is cached and shared by
the ranks). Without them the run goes on without the pool, as it did before, and says so. It is
installed only where the disk home fixed the threshold itself: a ``MALLOC_MMAP_THRESHOLD_`` of
the user's leaves malloc's behaviour, and this, to them. Like the fixed threshold, it stays for
the life of the process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

_log = logging.getLogger("longboat")

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <sys/mman.h>
#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

struct Pool final : at::Allocator {
  at::Allocator* base = nullptr;  // torch's default: every block below min_size
  size_t min_size = 0;
  size_t cap = 0;
  size_t kept = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  std::mutex lock;
  std::multimap<size_t, void*> free_blocks;  // kept, by size
  std::unordered_map<void*, size_t> sizes;   // the pool's blocks in use

  static void release(void* ptr);

  at::DataPtr allocate(size_t n) override {
    if (n < min_size) return base->allocate(n);
    size_t size = (n + 4095) & ~size_t(4095);
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> guard(lock);
      auto it = free_blocks.lower_bound(size);
      if (it != free_blocks.end() && it->first <= size + size / 4) {
        size = it->first;
        ptr = it->second;
        kept -= size;
        free_blocks.erase(it);
        hits++;
      } else {
        misses++;
      }
    }
    if (ptr == nullptr) {
      ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (ptr == MAP_FAILED) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "longboat's CPU pool: could not map ", size,
                         " bytes");
      }
    }
    {
      std::lock_guard<std::mutex> guard(lock);
      sizes[ptr] = size;
    }
    return {ptr, ptr, &Pool::release, at::Device(at::DeviceType::CPU)};
  }

  // One deleter for all this allocator's raw blocks (raw_allocate's contract): the pool's own,
  // or the default allocator's small ones.
  at::DeleterFnPtr raw_deleter() const override { return &Pool::release; }

  void free_block(void* ptr) {
    size_t size = 0;
    {
      std::lock_guard<std::mutex> guard(lock);
      auto it = sizes.find(ptr);
      if (it == sizes.end()) {
        base->raw_deleter()(ptr);
        return;
      }
      size = it->second;
      sizes.erase(it);
      if (size <= cap) {
        while (kept + size > cap && !free_blocks.empty()) {
          auto largest = std::prev(free_blocks.end());
          munmap(largest->second, largest->first);
          kept -= largest->first;
          free_blocks.erase(largest);
        }
        free_blocks.emplace(size, ptr);
        kept += size;
        return;
      }
    }
    munmap(ptr, size);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

Pool pool;
bool installed = false;
void Pool::release(void* ptr) { pool.free_block(ptr); }

}  // namespace

// Install once; a later call may raise the cap.
void install(int64_t cap, int64_t min_size) {
  std::lock_guard<std::mutex> guard(pool.lock);
  pool.cap = std::max(pool.cap, static_cast<size_t>(cap));
  if (!installed) {
    pool.base = c10::GetDefaultCPUAllocator();
    pool.min_size = static_cast<size_t>(min_size);
    c10::SetCPUAllocator(&pool, /*priority=*/100);
    installed = true;
  }
}

// hits, misses, bytes kept, cap
std::vector<int64_t> stats() {
  std::lock_guard<std::mutex> guard(pool.lock);
  return {pool.hits, pool.misses, static_cast<int64_t>(pool.kept),
          static_cast<int64_t>(pool.cap)};
}
"""


@functools.cache
def _extension() -> Any | None:
    """The pool's extension, built (or loaded from torch's cache) once per process; None
    where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(  # type: ignore[no-untyped-call]
            "longboat_cpu_pool", cpp_sources=_SOURCE, functions=["install", "stats"]
        )
    except Exception as e:  # no compiler, no headers: the run goes on without the pool
        _log.warning(
            "longboat: the CPU pool for large blocks could not be built (%s); offload runs "
            "without it, its large temporaries fresh from the system ([Note: warm blocks] in "
            "longboat/cpu_pool.py)",
            str(e).splitlines()[0] if str(e) else type(e).__name__,
        )
        return None


def install(cap: int, min_size: int) -> bool:
    """Give torch's CPU allocator a pool that keeps up to ``cap`` bytes of freed blocks of at
    least ``min_size`` bytes ([Note: warm blocks]); True where it is in place (a second call
    raises the cap to the larger)."""
    ext = _extension()
    if ext is None:
        return False
    ext.install(cap, min_size)
    _log.info(
        "longboat: a CPU pool keeps up to %.1f MiB of freed blocks of %.1f MiB and more, so "
        "large temporaries are reused warm under the fixed mmap threshold",
        cap / 2**20,
        min_size / 2**20,
    )
    return True


def stats() -> dict[str, int] | None:
    """The pool's allocations served from kept blocks and fresh, and the bytes it keeps; None
    where it is not built."""
    if _extension.cache_info().currsize == 0:  # never asked for: not built
        return None
    built = _extension()
    if built is None:
        return None
    hits, misses, kept, cap = built.stats()
    return {"hits": hits, "misses": misses, "kept": kept, "cap": cap}
