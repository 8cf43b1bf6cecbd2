"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from longboat.comm.collectives import NCCL_RULES_VAR
from longboat.testing import RankPools

# Every topology the tests build (in this process, in the pool's ranks, in launched scripts)
# enforces NCCL's rules on gloo ([Note: NCCL rules] in longboat/comm/collectives.py), so that a
# CPU tensor on the data plane, or a tensor of the model on the control plane, fails here too.
os.environ[NCCL_RULES_VAR] = "1"


@pytest.fixture(scope="session")
def ranks() -> Iterator[RankPools]:
    """Run a function on N gloo ranks: ``ranks(n, fn, *args, timeout=120, **kwargs)``.

    Returns one result per rank, in rank order, and raises ``RankFailure`` (an
    AssertionError) naming each failed rank. One worker pool per world size is started on
    first use and kept for the whole session, because starting processes and importing
    torch costs seconds while a call costs well under a millisecond. ``fn`` must be a
    module-level function (a test module's is fine), must return picklable values (CPU
    tensors, numbers, lists) and must leave no collective pending. ``ranks.pool(n)`` gives
    the underlying ``RankPool``.
    """
    pools = RankPools(timeout=120.0)
    try:
        yield pools
    finally:
        pools.close()
