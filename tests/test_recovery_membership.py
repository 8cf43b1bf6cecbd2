"""The survivors' agreement on the next generation ([Note: membership] in
longboat/recovery/membership.py), on an in-process store with one thread per survivor."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from longboat.recovery import Arrival, Membership, RecoveryError, agree
from longboat.recovery.membership import LEFT_STATUS, Left


def _together(store, arrivals, previous, **kwargs) -> dict[int, Membership | BaseException]:
    """Run ``agree`` for each arrival on its own thread; each one's membership or error."""
    out: dict[int, Membership | BaseException] = {}

    def one(a: Arrival) -> None:
        try:
            out[a.id] = agree(store, 1, previous, a, **kwargs)
        except BaseException as e:  # Left is a SystemExit
            out[a.id] = e

    threads = [threading.Thread(target=one, args=(a,)) for a in arrivals]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def test_survivors_agree_without_waiting_for_a_rank_the_launcher_saw_die():
    store = dist.HashStore()
    t0 = time.monotonic()
    got = _together(
        store,
        [Arrival(0, 3, ((0, 12),)), Arrival(2, 3, ((0, 12),))],
        (0, 1, 2),
        wait_s=30,
        dead=lambda: {1},
    )
    assert time.monotonic() - t0 < 5  # not the 30 s window
    assert got[0] == got[2] == Membership(1, (0, 2), (1,), 3, ((0, 12),))
    assert got[2].rank_of(2) == 1  # renumbered in the order of the old ranks


def test_without_news_of_the_death_the_window_closes_the_membership():
    got = _together(dist.HashStore(), [Arrival(0, 3), Arrival(2, 3)], (0, 1, 2), wait_s=0.3)
    assert got[0] == got[2] and got[0].members == (0, 2)


def test_every_rank_arriving_keeps_them_all():
    got = _together(dist.HashStore(), [Arrival(i, 0) for i in range(3)], (0, 1, 2), wait_s=30)
    assert {m.members for m in got.values()} == {(0, 1, 2)}


def test_in_blocks_only_whole_replicas_go_on_and_the_broken_ones_survivor_leaves():
    # Two replicas held by two ranks each (hybrid sharding): id 3 lost takes the second
    # replica with it, and id 2, alive, is told to leave (its launcher replaces it), naming
    # the lost id.
    got = _together(
        dist.HashStore(),
        [Arrival(i, 3, ((0, 12),)) for i in (0, 1, 2)],
        (0, 1, 2, 3),
        wait_s=30,
        dead=lambda: {3},
        block=2,
    )
    assert got[0] == got[1] == Membership(1, (0, 1), (2, 3), 3, ((0, 12),))
    assert isinstance(got[2], Left) and got[2].code == LEFT_STATUS, got[2]
    assert "lost 3" in got[2].message and "goes on with ids [0, 1]" in got[2].message


def test_in_blocks_the_replica_that_goes_on_keeps_each_rank_at_its_place_in_it():
    # id 0 lost: the second replica goes on as ranks 0 and 1, each keeping its shard; a
    # survivor of the other one at another step does not make the members disagree.
    got = _together(
        dist.HashStore(),
        [Arrival(1, 4), Arrival(2, 3), Arrival(3, 3)],
        (0, 1, 2, 3),
        wait_s=30,
        dead=lambda: {0},
        block=2,
    )
    assert got[2] == got[3] and got[2].members == (2, 3) and got[2].step == 3
    assert [got[2].rank_of(i) for i in (2, 3)] == [0, 1]
    assert isinstance(got[1], Left)


def test_in_blocks_no_whole_replica_left_is_an_error_on_every_survivor():
    got = _together(
        dist.HashStore(),
        [Arrival(0, 3), Arrival(3, 3)],
        (0, 1, 2, 3),
        wait_s=30,
        dead=lambda: {1, 2},
        block=2,
    )
    for i in (0, 3):
        assert isinstance(got[i], RecoveryError) and "no replica survived whole" in str(got[i])


def test_a_survivor_arriving_after_the_agreement_is_told_it_was_left_out():
    store = dist.HashStore()
    first = agree(store, 1, (0, 1, 2), Arrival(0, 3), wait_s=0.1)
    assert first.members == (0,)
    with pytest.raises(RecoveryError, match=r"rank 2 .* arrived after generation 1 was agreed"):
        agree(store, 1, (0, 1, 2), Arrival(2, 3), wait_s=0.1)


def test_survivors_at_different_steps_are_refused_naming_each():
    got = _together(
        dist.HashStore(), [Arrival(0, 3), Arrival(2, 4)], (0, 1, 2), wait_s=30, dead=lambda: {1}
    )
    for err in got.values():
        assert isinstance(err, RecoveryError)
        assert "rank 0: step 3" in str(err) and "rank 2: step 4" in str(err)


def test_a_death_published_by_another_nodes_launcher_closes_the_agreement():
    # [Note: deaths across nodes]: the survivors share no launcher with the lost rank 2; its
    # launcher's notice in the store is what they learn it from, not the 30 s window.
    from longboat.recovery.membership import DeathNotices, publish_death

    store = dist.HashStore()
    publish_death(store, 2)
    t0 = time.monotonic()
    # a reader per call: the two survivors' threads share the keyword arguments
    got = _together(
        store,
        [Arrival(0, 3), Arrival(1, 3)],
        (0, 1, 2),
        wait_s=30,
        dead=lambda: DeathNotices(store)(),
    )
    assert time.monotonic() - t0 < 5
    assert got[0] == got[1] and got[0].members == (0, 1) and got[0].lost == (2,)


def test_death_notices_are_read_in_order_with_the_local_records():
    from longboat.recovery.membership import DeathNotices, publish_death

    store = dist.HashStore()
    notices = DeathNotices(store, lambda: {7})
    assert notices() == {7}
    publish_death(store, 3)
    publish_death(store, 5)
    assert notices() == {3, 5, 7}
    assert DeathNotices(store)() == {3, 5}  # a reader that starts late reads them all
