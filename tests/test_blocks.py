"""The disk home's pool of unit-sized blocks ([Note: reused blocks] in
``strategies/zero/blocks.py``): memory freed into it is the next fill's, views follow their
tensor, the pool holds at most ``keep`` blocks a size, and the planner counts what it holds."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longboat.plan.tracker import LiveBytes
from longboat.strategies.zero.blocks import Blocks

N = 3 * 2**20  # floats: a 12 MiB block, a mapping of its own under the fixed mmap threshold


def test_memory_freed_into_the_pool_is_the_next_fill_and_views_follow_it():
    blocks = Blocks(keep=2)
    a = blocks.take(N, torch.float32)
    view = a[5:8]  # as the optimizer's pieces view a shard
    a.fill_(1.0)
    address = a.data_ptr()
    blocks.free(a)
    assert a.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert blocks.waiting_bytes == 4 * N
    b = torch.empty(N)
    blocks.free(b)  # another tensor's memory waits too
    blocks.fill(a)  # the last freed block
    assert a.untyped_storage().nbytes() == 4 * N and blocks.waiting_bytes == 4 * N
    a.fill_(2.0)
    assert view.tolist() == [2.0, 2.0, 2.0]  # the view sees the memory a holds now
    c = blocks.take(N, torch.float32)
    assert c.data_ptr() == address  # the first block, taken again
    assert blocks.waiting_bytes == 0 and (blocks.reused, blocks.fresh) == (2, 1)


def test_the_pool_holds_at_most_keep_blocks_of_a_size():
    blocks = Blocks(keep=2)
    for _ in range(3):
        blocks.free(torch.empty(N))
    blocks.free(torch.empty(N // 2))
    assert blocks.waiting_bytes == 2 * 4 * N + 4 * (N // 2)
    blocks.clear()
    assert blocks.waiting_bytes == 0


def test_recycling_takes_only_a_whole_buffer():
    blocks = Blocks(keep=2)
    base = torch.ones(N)
    part = base[: N // 2]
    blocks.recycle(part)  # part of another tensor: someone else's memory
    assert base.untyped_storage().nbytes() == 4 * N and blocks.waiting_bytes == 0
    assert base.sum().item() == N
    blocks.recycle(base)
    assert base.untyped_storage().nbytes() == 0 and blocks.waiting_bytes == 4 * N


def test_in_the_planners_run_what_waits_in_the_pool_counts_as_live():
    # The planner's run: fake tensors under its live-bytes tracker. A block freed into the
    # pool stays counted; filling from it neither adds nor counts it twice.
    blocks = Blocks(keep=1)
    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        a = torch.empty(N)
        assert tracker.live == 4 * N
        blocks.free(a)
        assert tracker.live == 4 * N and blocks.waiting_bytes == 4 * N
        blocks.fill(a)
        assert tracker.live == 4 * N and tracker.max_peak == 4 * N
        b = torch.empty(N)
        blocks.free(b)
        blocks.free(a)  # the pool is full at this size: a's memory goes
        assert tracker.live == 4 * N
        c = blocks.take(N, torch.float32)  # the waiting block becomes c
        assert tracker.live == 4 * N and tracker.max_peak == 8 * N
        del c
    assert blocks.waiting_bytes == 0


def test_off_the_cpu_nothing_is_pooled_nor_modelled():
    # The planner's run for a GPU: fake CUDA tensors (no GPU needed) are device memory; the pool
    # is the CPU's and holds none of it.
    blocks = Blocks(keep=2)
    tracker = LiveBytes()
    with FakeTensorMode(), tracker:
        a = torch.empty(N, device="cuda")
        blocks.free(a)
        assert blocks.waiting_bytes == 0 and a.untyped_storage().nbytes() == 0
