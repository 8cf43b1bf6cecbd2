"""The gradient norm every strategy clips by (``longboat.grads``), without processes."""

from __future__ import annotations

import torch

from longboat.grads import global_norm


def test_the_norm_of_a_long_flat_shard_is_as_exact_as_a_short_tensors():
    # A ZeRO shard is one flat tensor of many parameters; torch's CPU norm of four million
    # elements is off by 1e-4 of the squares ([Note: long norms] in longboat/grads.py).
    g = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    exact = float(g.double().pow(2).sum().sqrt())
    assert abs(float(global_norm([g], [])) - exact) <= 1e-6 * exact
