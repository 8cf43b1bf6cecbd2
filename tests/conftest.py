"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from longboat.testing import RankPools


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
