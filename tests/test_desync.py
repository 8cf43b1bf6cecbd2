"""The desync check: ranks out of step fail at that collective, on every rank, naming the rank
and the difference, instead of hanging or computing garbage."""

from __future__ import annotations

import pytest
import torch

from longboat.comm.collectives import Collectives, DesyncError
from longboat.testing import RankFailure


def _skip_one(odd: int) -> None:
    """Rank ``odd`` skips an all_reduce and goes straight to the next broadcast."""
    comm = Collectives(desync_check=True, timeout_s=30)
    try:
        t = torch.ones(4)
        comm.all_reduce(t)  # in step
        if comm.rank != odd:
            comm.all_reduce(t)
        comm.broadcast(t, 0)
    finally:
        comm.close()


def _dtype(odd: int) -> None:
    comm = Collectives(desync_check=True, timeout_s=30)
    try:
        comm.all_reduce(torch.ones(4, dtype=torch.float64 if comm.rank == odd else torch.float32))
    finally:
        comm.close()


def _shape(odd: int) -> None:
    comm = Collectives(desync_check=True, timeout_s=30)
    try:
        comm.all_reduce(torch.ones(5 if comm.rank == odd else 4))
    finally:
        comm.close()


def _in_step() -> list[float]:
    """With the check on, collectives that agree compute what they would without it."""
    comm = Collectives(desync_check=True, timeout_s=30)
    try:
        t = torch.full((3,), float(comm.rank + 1))
        comm.all_reduce(t)
        out = torch.empty(2 * comm.world_size)
        comm.all_gather(out, torch.full((2,), float(comm.rank)))
        comm.barrier()
        return [*t.tolist(), *out.tolist(), float(comm.seq)]
    finally:
        comm.close()


CASES = {
    "skip": (
        _skip_one,
        "broadcast(float32[4])",
        "all_reduce(float32[4])",
        "a rank skipped or added a collective",
    ),
    "dtype": (_dtype, "all_reduce(float64[4])", "all_reduce(float32[4])", "different dtypes"),
    "shape": (_shape, "all_reduce(float32[5])", "all_reduce(float32[4])", "different shapes"),
}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_desync_fails_on_every_rank_naming_rank_and_difference(ranks, n: int, case: str) -> None:
    fn, odd_sig, ref_sig, why = CASES[case]
    odd = n - 1
    with pytest.raises(RankFailure) as info:
        ranks(n, fn, odd)
    failures = info.value.failures
    assert sorted(failures) == list(range(n)), f"every rank must raise: {failures}"
    others = "rank 0" if n == 2 else "ranks " + ", ".join(map(str, range(n - 1)))
    for r, text in failures.items():
        assert DesyncError.__name__ in text and f"seen by rank {r} of {n}" in text, text
        assert f"rank {odd} entered {odd_sig} at test_desync.py:" in text, text
        assert f"where {others} entered {ref_sig} at test_desync.py:" in text, text
        assert why in text, text


def test_collectives_in_step_are_unchanged_by_the_check(ranks) -> None:
    got = ranks(2, _in_step)
    expected = [3.0, 3.0, 3.0, 0.0, 0.0, 1.0, 1.0, 3.0]
    assert got == [expected, expected]


def _async_tags(odd: int) -> None:
    """Asynchronous gathers of same-shaped tensors of different things ([Note: overlapped
    check]): nothing blocks at issue, the mismatch is raised at ``wait``, before the result is
    used."""
    comm = Collectives(desync_check=True, timeout_s=30)
    try:
        out = torch.empty(4 * comm.world_size)
        ok = comm.all_gather(out, torch.ones(4), async_op=True, tag="unit 0: a")
        ok.wait()  # in step
        tag = "unit 2: c" if comm.rank == odd else "unit 1: b"
        handle = comm.all_gather(out, torch.ones(4), async_op=True, tag=tag)
        handle.wait()
    finally:
        comm.close()


@pytest.mark.parametrize("n", [2, 4])
def test_asynchronous_collectives_are_checked_at_wait(ranks, n: int) -> None:
    odd = n - 1
    with pytest.raises(RankFailure) as info:
        ranks(n, _async_tags, odd)
    failures = info.value.failures
    assert sorted(failures) == list(range(n)), f"every rank must raise: {failures}"
    for r, text in failures.items():
        assert DesyncError.__name__ in text and "collective #2" in text, text
        assert "different tensors of the same shape" in text, text
        mine = "[unit 2: c]" if r == odd else "[unit 1: b]"
        assert mine in text, text  # each rank words its own collective in full
