"""Bucket plans are pure: tested without processes."""

import torch
from torch import nn

from longboat.comm.buckets import plan_buckets


def _params(*sizes: int, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in sizes]


def test_reverse_order_and_cap():
    ps = _params(10, 20, 30, 40)  # fp32: 40, 80, 120, 160 bytes
    plan = plan_buckets(ps, bucket_bytes=200)
    order = [[int(p.numel()) for p in b.params] for b in plan.buckets]
    assert order == [[40], [30, 20], [10]]
    assert [b.numel for b in plan.buckets] == [40, 50, 10]
    b, i = plan.locate(ps[1])
    assert b.index == 1 and b.offsets[i] == 30


def test_first_bucket_is_small_and_big_params_get_their_own():
    ps = _params(5, 5, 5, 1000)
    plan = plan_buckets(ps, bucket_bytes=100, first_bucket_bytes=10)
    sizes = [[int(p.numel()) for p in b.params] for b in plan.buckets]
    assert sizes == [[1000], [5, 5, 5]]


def test_dtype_change_closes_bucket_and_frozen_and_tied_skipped():
    a, b = _params(4, 4)
    (c,) = _params(4, dtype=torch.float64)
    (frozen,) = _params(4)
    frozen.requires_grad_(False)
    plan = plan_buckets([a, frozen, c, b, a], bucket_bytes=10_000)
    # reversed: a, b | c (fp64) ; the second a is the same tied parameter, taken once
    assert [len(x.params) for x in plan.buckets] == [2, 1]
    assert id(frozen) not in plan.where
    assert sum(x.numel for x in plan.buckets) == 12


def test_views_cover_the_buffer_without_overlap():
    ps = _params(3, 7, 11)
    plan = plan_buckets(ps, bucket_bytes=10_000)
    (bucket,) = plan.buckets
    bucket.allocate()
    for i in range(len(bucket.params)):
        bucket.view_of(i).fill_(i + 1)
    assert bucket.buffer is not None
    assert torch.equal(bucket.buffer[:11], torch.full((11,), 1.0))
    # Gradients fill the first numel elements; one usage flag per parameter follows them.
    assert int((bucket.buffer[: bucket.numel] == 0).sum()) == 0
    assert bucket.size == bucket.numel + 3 == bucket.buffer.numel()
    bucket.flags().fill_(7)
    assert int((bucket.buffer[bucket.numel :] == 7).sum()) == 3
