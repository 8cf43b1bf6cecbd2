"""Unit-sized CPU memory handed from one use to the next instead of back to the system.

[Note: reused blocks] Offload to disk fills a unit's shards and optimizer state from files and
drops them a unit later, several times a step ([Note: parameter offload] in ``shard_swap.py``).
Freed at once (glibc maps buffers of a unit's size and unmaps them when freed: [Note: fixed mmap
threshold] in ``heap.py``), each use is a fresh mapping whose pages the kernel faults in and
zeroes, and unmaps again: on two ranks of the 84M-parameter GPT of ``offload_headline.py
--layers 6``, the offloaded step spent 1.13 s a rank in the kernel against 0.38 s in memory, and
with every freed buffer kept in glibc's heap instead (``MALLOC_MMAP_THRESHOLD_`` above the unit
size) it spent 0.36 s and took as long as in memory, but the heap then held 2.4-2.8 GiB a rank
on the 272M-parameter GPT, 2.5x the 1 GiB budget: memory freed in the middle of the heap stays
resident.

So the disk home keeps what it frees in a small pool of its own: a tensor "freed" into it hands
its memory to the pool (its storage swaps data pointers with an empty one, so the tensor and
every view of it stay valid and hold nothing: [Note: storage resize] in ``storage.py``), and a
tensor "filled" takes a block of exactly its size when the pool has one. At most ``keep``
blocks of each size wait in the pool; more go back to the system. What waits is memory the
home's next few uses need, as the disk home's own read-ahead (``buffer_count``) bounds them; the
planner counts it ([Note: planning the pool] below). Fresh blocks are mappings of their own
(``mmap``), so a block the pool lets go returns to the system whatever malloc's threshold.

On the 272M-parameter GPT of ``offload_headline.py`` (2 ranks, 1 GiB budget each) the
offloaded step went from 1.73x the in-memory one to 1.50x with the pool (one job of each), and to
1.29x and 1.35x (two alternating rounds, ``benchmarks/results/offload_headline.json``) when the
units also stepped with the fused CPU Adam (``cpu_step.py``), whose per-parameter temporaries
had been fresh mappings too; peak RSS 920 and 915 MiB, against 851 and 800 before.

[Note: planning the pool] In the planner's run on fake tensors the pool is modelled rather than
skipped: a tensor freed into it leaves a fake block of its size waiting, counted live by the
planner's tracker as the real block is resident, and a fill or take drops one before allocating
its replacement, so the plan's offload rows include what the pool holds.

Where torch has no ``UntypedStorage._swap_data_ptr_`` (before it existed), and in the planner's
run on fake tensors, filling and freeing resize the storage as before.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from typing import Literal

import torch
from torch._subclasses.fake_tensor import FakeTensor

from longboat.heap import HUGE_MIN
from longboat.strategies.zero.storage import alloc_storage, empty, free_storage, huge_pages

#: Exchanges two storages' memory (data pointer and size), the tensors and views on each
#: staying where they are: what FSDP and CUDA graph trees use to refill a storage in place.
_SWAP: Callable[[torch.UntypedStorage, torch.UntypedStorage], None] | None = getattr(
    torch.UntypedStorage, "_swap_data_ptr_", None
)


def _new_block(nbytes: int) -> torch.UntypedStorage:
    """Fresh memory for the pool: a mapping of its own, whatever malloc's threshold, so that a
    block the pool lets go returns to the system at once (asked for huge pages)."""
    if nbytes < HUGE_MIN:
        return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor's memory keeps the mapping alive; it is unmapped when the last holder goes.
    return huge_pages(torch.frombuffer(mapping, dtype=torch.uint8)).untyped_storage()


class Blocks:
    """A pool of CPU blocks by size ([Note: reused blocks]); thread-safe (the disk home's I/O
    thread frees what it wrote).

    In the planner's run on fake tensors the pool is modelled ([Note: planning the pool])."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: dict[int, list[torch.UntypedStorage | torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.reused = 0  # fills and takes served from the pool
        self.fresh = 0  # fills and takes that asked the system

    @staticmethod
    def _kind(t: torch.Tensor) -> Literal["swap", "model", "plain"]:
        """ "swap": pooled; "model": the planner's fake tensors; "plain": no pool (not on the
        CPU, or a torch without the swap)."""
        if t.device.type != "cpu":
            return "plain"
        if isinstance(t, FakeTensor):
            return "model"
        return "swap" if _SWAP is not None else "plain"

    def _pop(self, nbytes: int) -> torch.UntypedStorage | torch.Tensor | None:
        with self._lock:
            waiting = self._free.get(nbytes)
            block = waiting.pop() if waiting else None
            self.reused += block is not None
            self.fresh += block is None
            return block

    def _push(self, nbytes: int, block: torch.UntypedStorage | torch.Tensor) -> bool:
        """``block`` waits in the pool; False where ``keep`` of its size wait already."""
        with self._lock:
            waiting = self._free.setdefault(nbytes, [])
            if len(waiting) >= self.keep:
                return False
            waiting.append(block)
            return True

    def fill(self, t: torch.Tensor) -> None:
        """Give a freed ``t`` (contiguous from offset 0) its memory, contents undefined."""
        need = t.numel() * t.element_size()
        st = t.untyped_storage()
        kind = self._kind(t)
        if st.nbytes() == need:
            return
        if kind == "plain" or st.nbytes():
            alloc_storage(t)
            return
        block = self._pop(need)
        if kind == "model":
            del block  # it was counted while it waited, and is the memory t takes
            alloc_storage(t)
            return
        if block is None:
            block = _new_block(need)
        assert isinstance(block, torch.UntypedStorage) and _SWAP is not None
        _SWAP(st, block)  # t has the memory; the block is an empty shell now

    def free(self, t: torch.Tensor) -> None:
        """Take ``t``'s memory (all of its storage's), leaving ``t`` and its views empty."""
        st = t.untyped_storage()
        n = st.nbytes()
        kind = self._kind(t)
        if not n:
            return
        if kind != "swap":
            free_storage(t)
            if kind == "model":
                self._push(n, torch.empty(n, dtype=torch.uint8))  # fake: counted while it waits
            return
        assert _SWAP is not None
        shell = torch.empty(0, dtype=torch.uint8).untyped_storage()
        _SWAP(st, shell)  # t holds nothing now; the shell has the memory
        self._push(n, shell)  # else dropped here: the pool is full at this size

    def recycle(self, t: torch.Tensor) -> None:
        """Into the pool if ``t`` is the whole of its storage and pooled (the caller's own
        buffer, done with: nobody else may hold it); otherwise left to be freed when its last
        user goes."""
        st = t.untyped_storage()
        whole = t.storage_offset() == 0 and st.nbytes() == t.numel() * t.element_size()
        if whole and t.is_contiguous() and self._kind(t) != "plain":
            self.free(t)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new flat CPU buffer of ``numel`` elements, from the pool where it has one,
        contents undefined."""
        probe = torch.empty(0, dtype=dtype)  # a fake one in the planner's run
        kind = self._kind(probe)
        block = self._pop(numel * dtype.itemsize) if kind != "plain" else None
        if kind == "swap":
            if block is None:
                block = _new_block(numel * dtype.itemsize)
            assert isinstance(block, torch.UntypedStorage)
            return probe.set_(block, 0, (numel,), (1,))
        del block  # modelled: dropped before the allocation that replaces it
        return empty(numel, dtype, "cpu")

    @property
    def waiting_bytes(self) -> int:
        """Bytes waiting in the pool now."""
        with self._lock:
            return sum(n * len(v) for n, v in self._free.items())

    def clear(self) -> None:
        """Everything waiting back to the system."""
        with self._lock:
            self._free.clear()


__all__ = ["Blocks"]
