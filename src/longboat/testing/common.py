"""What both sides of the rank pool share: how a worker knows it is one, and how a failed call
is reported."""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Set to "1" in every pool worker; read by :func:`in_rank_pool`.
POOL_ENV_VAR = "LONGBOAT_RANK_POOL"

HOST = "127.0.0.1"
# How often an idle or stuck worker checks that its parent is still alive.
ORPHAN_POLL_S = 0.5


def in_rank_pool() -> bool:
    """Return True when called inside a :class:`RankPool` worker."""
    return os.environ.get(POOL_ENV_VAR) == "1"


class RankFailure(AssertionError):
    """One or more ranks raised, died, or did not answer in time.

    Subclasses AssertionError so pytest reports it as a test failure, not an error in the
    test machinery. ``failures`` maps each failed rank to its traceback or explanation.
    """

    def __init__(self, message: str, failures: Mapping[int, str]) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures)


#: How a worker says a call left threads of longboat's running: its workers are then replaced.
LEFT_THREADS = "the call left threads running"
