"""Tests of the multi-rank test harness in longboat.testing.

Functions run on ranks live at module level because they are pickled by reference.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from longboat.testing import RankFailure, RankPool, RankPools, in_rank_pool

# Short enough to keep the file fast, long enough for a loaded two-core machine.
HANG_TIMEOUT_S = 2.0


def _all_reduce_rank_plus_one() -> float:
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    return value.item()


def _describe_worker() -> dict[str, object]:
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {
            key: os.environ[key]
            for key in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
            )
        },
        "in_pool": in_rank_pool(),
        "threads": torch.get_num_threads(),
    }


def _scaled_rank_tensor(offset: float, *, scale: float) -> torch.Tensor:
    return torch.full((2,), (dist.get_rank() + offset) * scale)


def _raise_on_rank_one_then_all_reduce() -> float:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    # Rank 0 now waits for a partner that will never come: the case the pool must clean up.
    return _all_reduce_rank_plus_one()


def _rank_one_waits_in_lonely_all_reduce() -> int:
    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _sleep_then_return(seconds: float, value: str) -> str:
    time.sleep(seconds)
    return value


def _return_unpicklable() -> object:
    return lambda: None


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_sums(ranks: RankPools, world_size: int) -> None:
    expected = world_size * (world_size + 1) / 2
    assert ranks(world_size, _all_reduce_rank_plus_one) == [expected] * world_size


def test_workers_know_their_rank_and_environment(ranks: RankPools) -> None:
    described = ranks(2, _describe_worker)
    for rank, info in enumerate(described):
        assert info["rank"] == rank
        assert info["world_size"] == 2
        assert info["backend"] == "gloo"
        assert info["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
        }
        assert info["in_pool"] is True
        assert info["threads"] == 1
    assert not in_rank_pool()


def test_args_kwargs_and_tensor_results(ranks: RankPools) -> None:
    results = ranks(2, _scaled_rank_tensor, 0.5, scale=2.0)
    torch.testing.assert_close(results, [torch.full((2,), 1.0), torch.full((2,), 3.0)])


def test_rank_error_is_reported_and_pool_recovers(
    ranks: RankPools, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = ranks.pool(2)
    # Rank 0 will sit in its all_reduce; no need to give it the default grace to answer.
    monkeypatch.setattr(pool, "error_grace", 1.0)
    with pytest.raises(RankFailure) as caught:
        ranks(2, _raise_on_rank_one_then_all_reduce)
    message = str(caught.value)
    assert "--- rank 1 ---" in message
    assert "ValueError: boom on rank 1" in message
    assert "_raise_on_rank_one_then_all_reduce" in message
    assert set(caught.value.failures) == {0, 1}
    assert "did not answer" in caught.value.failures[0]
    # The workers were replaced (rank 0 was stuck in a collective) and the pool works.
    ports_before = pool.port
    assert ranks(2, _all_reduce_rank_plus_one) == [3.0, 3.0]
    assert pool.port == ports_before  # no second restart on the healthy call


def _every_rank_raises() -> None:
    raise ValueError(f"refused on rank {dist.get_rank()}")


def _rank_zero_leaves_an_all_reduce_unpaired_then_every_rank_raises() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # nobody pairs it: the group is spoilt
    raise ValueError(f"refused on rank {dist.get_rank()}")


def _fail_on_a_ready_pool(ranks: RankPools, fn: Any, *args: Any) -> tuple[RankFailure, list[int]]:
    """The 2-rank pool started, its workers' pids, then ``fn`` failing there: the failure."""
    ranks(2, _all_reduce_rank_plus_one)
    pids = ranks.pool(2).pids
    with pytest.raises(RankFailure) as caught:
        ranks(2, fn, *args)
    return caught.value, pids


def test_a_call_every_rank_raised_in_keeps_the_workers(ranks: RankPools) -> None:
    failure, pids = _fail_on_a_ready_pool(ranks, _every_rank_raises)
    pool = ranks.pool(2)
    assert "still usable" in str(failure)
    assert set(failure.failures) == {0, 1}
    assert pool.pids == pids
    assert ranks(2, _all_reduce_rank_plus_one) == [3.0, 3.0]


def test_a_collective_left_unpaired_by_a_failed_call_replaces_the_workers(
    ranks: RankPools,
) -> None:
    fn = _rank_zero_leaves_an_all_reduce_unpaired_then_every_rank_raises
    failure, pids = _fail_on_a_ready_pool(ranks, fn)
    assert "the pool was restarted" in str(failure)
    assert set(ranks.pool(2).pids).isdisjoint(pids)
    assert ranks(2, _all_reduce_rank_plus_one) == [3.0, 3.0]


def _start_a_thread_that_never_ends(refuse: bool) -> None:
    import threading

    threading.Thread(target=time.sleep, args=(3600,), name="longboat-left", daemon=True).start()
    if refuse:
        raise ValueError(f"refused on rank {dist.get_rank()}")


@pytest.mark.parametrize("refuse", [False, True], ids=["returned", "raised"])
def test_a_call_that_leaves_a_thread_running_fails_and_the_workers_are_replaced(
    ranks: RankPools, refuse: bool
) -> None:
    # A thread a test leaves running lives on into later tests of the same worker: a
    # heartbeat thread so held the interpreter's lock when a DataLoader forked there.
    failure, pids = _fail_on_a_ready_pool(ranks, _start_a_thread_that_never_ends, refuse)
    assert "the call left threads running: longboat-left" in str(failure)
    assert "the pool was restarted" in str(failure)
    assert set(ranks.pool(2).pids).isdisjoint(pids)
    assert ranks(2, _all_reduce_rank_plus_one) == [3.0, 3.0]


def test_hung_rank_is_reported_and_pool_recovers(ranks: RankPools) -> None:
    pool = ranks.pool(2)
    old_pids = pool.pids
    started = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        ranks(2, _rank_one_waits_in_lonely_all_reduce, timeout=HANG_TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert elapsed < HANG_TIMEOUT_S + 5.0
    assert set(caught.value.failures) == {1}
    assert "did not answer within" in caught.value.failures[1]
    # Where it hung: its threads' stacks, down to the function the call ran.
    assert "where its threads were:" in caught.value.failures[1]
    assert "_rank_one_waits_in_lonely_all_reduce" in caught.value.failures[1]
    assert "Ranks that answered normally: 0." in str(caught.value)
    assert set(pool.pids).isdisjoint(old_pids)
    assert ranks(2, _all_reduce_rank_plus_one) == [3.0, 3.0]


def test_unpicklable_function_fails_in_caller_without_restart(ranks: RankPools) -> None:
    pool = ranks.pool(1)
    ranks(1, _all_reduce_rank_plus_one)  # make sure the pool is up, so pids are stable
    pids = pool.pids
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        ranks(1, lambda: 0)
    assert pool.pids == pids


def test_unpicklable_result_is_a_rank_failure_without_restart(ranks: RankPools) -> None:
    pool = ranks.pool(2)
    ranks(2, _all_reduce_rank_plus_one)  # make sure the pool is up, so pids are stable
    pids = pool.pids
    with pytest.raises(RankFailure, match="could not be pickled") as caught:
        ranks(2, _return_unpicklable)
    assert set(caught.value.failures) == {0, 1}
    assert "still usable" in str(caught.value)
    # The call completed on every rank, so the workers were kept.
    assert pool.pids == pids
    assert ranks(2, _all_reduce_rank_plus_one) == [3.0, 3.0]


class _Interrupted(Exception):
    """Stands in for KeyboardInterrupt, which would also stop pytest."""


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX interval timers")
def test_interrupted_call_leaves_no_stale_replies(ranks: RankPools) -> None:
    pool = ranks.pool(1)
    ranks(1, os.getpid)  # the pool is up, so the timer below fires during the call
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(_Interrupted):
            ranks(1, _sleep_then_return, 1.0, "stale")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # The interrupted call's reply must not be taken as this call's.
    assert ranks(1, _all_reduce_rank_plus_one) == [1.0]
    assert pool.pids


def test_close_stops_workers() -> None:
    with RankPool(1) as pool:
        assert pool.run(_all_reduce_rank_plus_one) == [1.0]
        processes = pool._generation.processes if pool._generation else []
    assert processes and not any(process.is_alive() for process in processes)
    assert processes[0].exitcode == 0  # left through the polite path, not SIGKILL
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(_all_reduce_rank_plus_one)


def _is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_workers_exit_when_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "orphan.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal
            from longboat.testing import RankPool

            if __name__ == "__main__":
                pool = RankPool(1)
                pool.run(os.getpid)
                print(*pool.pids, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no finalizers
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    pids = [int(pid) for pid in proc.stdout.split()]
    assert pids, proc.stderr
    deadline = time.monotonic() + 10.0
    while any(_is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_is_running(pid) for pid in pids)
