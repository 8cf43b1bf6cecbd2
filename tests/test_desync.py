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
    check]): the mismatch is raised before the result is used (at issue on gloo, at ``wait``
    where the data goes by another backend)."""
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


def _async_sizes(odd: int, op: str) -> None:
    """Asynchronous collectives of different sizes, waited after a pause: on gloo the data of a
    mismatch must never go out (its transport aborts the receiving process in its own thread,
    [Note: overlapped check]); every rank raises DesyncError instead."""
    import time

    comm = Collectives(desync_check=True, timeout_s=30)
    try:
        n = 6 if comm.rank == odd else 4
        x = torch.ones(n * comm.world_size)
        if op == "all_gather":
            h = comm.all_gather(torch.empty(n * comm.world_size), x[:n], async_op=True)
        elif op == "reduce_scatter":
            h = comm.reduce_scatter(torch.empty(n), x, async_op=True, scratch=True)
        else:
            h = comm.all_reduce(x, async_op=True)
        time.sleep(0.3)  # long enough for a peer's bytes to arrive, had they been sent
        h.wait()
    finally:
        comm.close()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter", "all_reduce"])
def test_asynchronous_collectives_of_different_sizes_fail_without_an_abort(ranks, n, op) -> None:
    odd = n - 1
    with pytest.raises(RankFailure) as info:
        ranks(n, _async_sizes, odd, op)
    failures = info.value.failures
    assert sorted(failures) == list(range(n)), f"every rank must raise: {failures}"
    for text in failures.values():
        assert DesyncError.__name__ in text and "different shapes" in text, text
        assert "worker died" not in text, text
