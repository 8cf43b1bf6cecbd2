"""Asynchronous Horovod operations matched by name, whatever order each rank issues them in
([Note: Horovod pending operations] in longboat/horovod/pending.py), at 2 and 3 ranks. The
expected values are computed with plain torch.distributed on the same ranks, in one fixed
order, or with plain torch here."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

NAMES = ("a", "b", "c", "d")


def _tensor(rank: int, name: str) -> torch.Tensor:
    """Rank ``rank``'s tensor for ``name``: its own shape, dtype and values per name."""
    k = NAMES.index(name)
    t = torch.arange(3.0 + k) * (rank + 1) + 10 * k
    return t.to(torch.int64) if name == "c" else t


def _reordered() -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    order = NAMES[r % len(NAMES) :] + NAMES[: r % len(NAMES)]  # each rank starts elsewhere
    handles = {}
    for name in order:
        if name == "d":  # a grouped one, issued in place
            pair = [_tensor(r, "d"), _tensor(r, "d")[:2].clone()]
            handles[name] = (hvd.grouped_allreduce_async_(pair, name=name, op=hvd.Sum), pair)
        else:
            op = hvd.Average if name == "b" else hvd.Sum
            handles[name] = (hvd.allreduce_async(_tensor(r, name), name=name, op=op), None)
        if name == order[1]:  # a blocking collective while the others wait in the queue
            blocking = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item()
    got = {name: hvd.synchronize(handles[name][0]) for name in reversed(order)}
    in_place = handles["d"][1]
    got["d"] = [t.clone() for t in got["d"]]
    # The same sums with plain torch.distributed, every rank in one order.
    want = {}
    for name in NAMES:
        t = _tensor(r, name)
        dist.all_reduce(t)
        want[name] = t / n if name == "b" else t
    return {
        "got": got,
        "want": want,
        "blocking": blocking,
        "in place": got["d"][0].equal(in_place[0]),
    }


@pytest.mark.parametrize("n", [2, 3])
def test_async_ops_issued_in_different_orders_are_matched_by_name(ranks, n):
    for r, out in enumerate(ranks(n, _reordered)):
        got, want = out["got"], out["want"]
        for name in "abc":
            assert got[name].dtype == want[name].dtype, (r, name)
            assert torch.equal(got[name], want[name]), (r, name, got[name], want[name])
        total = sum(_tensor(q, "d") for q in range(n))
        assert torch.equal(got["d"][0], want["d"]) and torch.equal(got["d"][0], total)
        assert torch.equal(got["d"][1], total[:2]) and out["in place"]
        assert out["blocking"] == sum(range(n))


def _same_name_differs() -> dict:
    """Ranks issue "x" and "y" in different orders; "x" differs in shape on rank 1."""
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    x = torch.ones(2 + (r == 1))
    y = torch.full((2,), float(r + 1))
    if r % 2:
        hy, hx = hvd.allreduce_async(y, name="y", op=hvd.Sum), hvd.allreduce_async(x, name="x")
    else:
        hx, hy = hvd.allreduce_async(x, name="x"), hvd.allreduce_async(y, name="y", op=hvd.Sum)
    try:
        hvd.synchronize(hx)
        error = ""
    except hvd.HorovodInternalError as e:
        error = str(e)
    return {"error": error, "y": hvd.synchronize(hy).tolist()}


@pytest.mark.parametrize("n", [2, 3])
def test_a_name_whose_shapes_differ_fails_on_every_rank_and_the_rest_completes(ranks, n):
    got = ranks(n, _same_name_differs)
    for r, out in enumerate(got):
        assert "Mismatched allreduce tensor shapes" in out["error"], (r, out)
        assert "rank 0: [[2]]; rank 1: [[3]]" in out["error"], (r, out)
        assert out["y"] == [float(sum(range(1, n + 1)))] * 2, (r, out)
    assert len({out["error"] for out in got}) == 1


def _waiting_for_what_no_peer_issued() -> dict:
    """Rank 0 waits for "x", the others for "y": no rank could ever go on."""
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    mine, theirs = ("x", "y") if r == 0 else ("y", "x")
    first = hvd.allreduce_async(torch.ones(1), name=mine, op=hvd.Sum)
    try:
        hvd.synchronize(first)
        error = ""
    except hvd.HorovodInternalError as e:
        error = str(e)
    # Each rank then issues the one it lacked: both complete, the ranks are in step again.
    second = hvd.allreduce_async(torch.ones(1), name=theirs, op=hvd.Sum)
    return {"error": error, "sums": [hvd.synchronize(h).item() for h in (first, second)]}


def test_every_rank_waiting_for_a_name_no_peer_issued_is_an_error_not_a_hang(ranks):
    got = ranks(3, _waiting_for_what_no_peer_issued)
    for r, out in enumerate(got):
        assert "No collective can run" in out["error"], (r, out)
        assert "rank 0 waits for 'x'" in out["error"] and "rank 2 waits for 'y'" in out["error"]
        assert out["sums"] == [3.0, 3.0], (r, out)


def _wait_for(signal: str, failure: str) -> None:
    """Until the file ``signal`` exists (another rank's sign), at most 60 s."""
    deadline = time.monotonic() + 60
    while not Path(signal).exists():
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


def _poll_before_the_peer_issues(signal: str) -> dict:
    """Rank 0 polls its "x" before rank 1 has issued it; rank 1 issues it only once rank 0 has
    said, through a file, that its poll returned."""
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    out: dict = {}
    if r == 0:
        handle = hvd.allreduce_async(torch.tensor([1.0, 2.0]), name="x", op=hvd.Sum)
        out["polled"] = hvd.poll(handle)
        Path(signal).write_text("polled")
    else:
        _wait_for(signal, "rank 0 never polled")
        handle = hvd.allreduce_async(torch.tensor([10.0, 20.0]), name="x", op=hvd.Sum)
    out["sum"] = hvd.synchronize(handle).tolist()
    out["after"] = hvd.poll(handle)
    return out


def test_poll_is_false_while_a_peer_has_not_issued_the_operation(ranks, tmp_path):
    got = ranks(2, _poll_before_the_peer_issues, str(tmp_path / "signal"))
    assert got[0]["polled"] is False
    assert all(out["sum"] == [11.0, 22.0] and out["after"] is True for out in got), got


def test_a_round_starts_the_common_names_in_the_lowest_ranks_order_without_processes():
    from longboat.horovod.negotiate import Offer, decide, request

    def q(name: str, rows: int = 2):
        return request("allreduce", [torch.ones(rows)], name=name, reduce="sum")

    on = (True, True, True)
    offers = {
        0: Offer(None, (q("b"), q("a"), q("c")), "b"),
        1: Offer(None, (q("a"), q("c", rows=3), q("b")), "a"),
        2: Offer(q("z"), (q("c", rows=3), q("b"), q("a")), blocking=False),
    }
    r = decide(on, on, offers)
    assert [x.name for x in r.started] == ["b", "a"]  # rank 0's order; "c" differs
    assert list(r.failed) == ["c"] and "rank 0: [[2]]; rank 1: [[3]]" in str(r.failed["c"])
    assert r.now is None and r.error is None  # rank 2 is in "z" alone: a later round
    # Nothing in common and every rank waiting: an error naming what each waits for.
    stuck = decide(on[:2], on[:2], {0: Offer(None, (q("x"),), "x"), 1: Offer(q("y"))})
    assert stuck.error is not None and not stuck.started
    assert "rank 0 waits for 'x'" in str(stuck.error) and "rank 1 waits in allreduce 'y'" in str(
        stuck.error
    )
    # The same, but one rank only polls: it may still issue what the other waits for.
    polling = {0: Offer(None, (q("x"),), "x"), 1: Offer(None, (q("y"),), "y", blocking=False)}
    assert decide(on[:2], on[:2], polling).error is None
    # Ranks in different collectives: the existing mismatch, after starting what is common.
    r = decide(on[:2], on[:2], {0: Offer(q("u"), (q("a"),)), 1: Offer(q("v"), (q("a"),))})
    assert [x.name for x in r.started] == ["a"] and "tensor names" in str(r.error)


def _joined_rank_serves_reordered() -> dict:
    """Rank 2 joins at once; ranks 0 and 1 reduce "a" and "c" asynchronously in different
    orders: the joined rank must add zeros to each in the order the others start them."""
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    if r == 2:
        return {"last": hvd.join()}
    order = ("a", "c") if r == 0 else ("c", "a")
    handles = {k: hvd.allreduce_async(_tensor(r, k), name=k, op=hvd.Sum) for k in order}
    got = {k: hvd.synchronize(handles[k]) for k in reversed(order)}
    return {"got": got, "last": hvd.join()}


def test_a_joined_rank_serves_async_ops_the_others_issued_in_different_orders(ranks):
    got = ranks(3, _joined_rank_serves_reordered)
    for r in (0, 1):
        for k in "ac":
            want = _tensor(0, k) + _tensor(1, k)
            assert torch.equal(got[r]["got"][k], want), (r, k, got[r]["got"][k], want)
    assert [out["last"] for out in got] == [1, 1, 1]


def _shutdown_while_a_peer_waits() -> dict:
    """Rank 1 waits for "x", which rank 0 has not issued: rank 0 shuts down instead. Both raise,
    naming what each waits for, instead of hanging; rank 0 stays in the job, so it can then
    issue "x" and both complete it."""
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    handle, error = None, ""
    try:
        if r == 0:
            hvd.shutdown()
        else:
            handle = hvd.allreduce_async(torch.ones(1), name="x", op=hvd.Sum)
            hvd.synchronize(handle)
    except hvd.HorovodInternalError as e:
        error = str(e)
    if r == 0:
        handle = hvd.allreduce_async(torch.ones(1), name="x", op=hvd.Sum)
    return {"error": error, "in group": dist.is_initialized(), "x": hvd.synchronize(handle).item()}


def test_shutdown_while_a_peer_waits_for_an_async_op_is_an_error_on_both(ranks):
    got = ranks(2, _shutdown_while_a_peer_waits)
    for r, out in enumerate(got):
        assert "No collective can run" in out["error"], (r, out)
        assert "rank 0 waits in barrier" in out["error"], (r, out)
        assert "rank 1 waits for 'x'" in out["error"], (r, out)
        assert out["in group"] and out["x"] == 2.0, (r, out)


def _both_poll_in_different_orders(signal: str) -> dict:
    """Both ranks poll "x" with "x" and "y" issued in different orders (so the round needs the
    offers themselves); rank 1 then waits for rank 0 to have polled several more times, which
    must not wait for rank 1's offer."""
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    names = ("x", "y") if r == 0 else ("y", "x")
    handles = {
        k: hvd.allreduce_async(torch.tensor([float(r + 1)]), name=k, op=hvd.Sum) for k in names
    }
    polls = [hvd.poll(handles["x"])]
    if r == 0:
        for _ in range(20):  # the headers arrive meanwhile; rank 1 sends its offer only later
            polls.append(hvd.poll(handles["x"]))
            time.sleep(0.01)
        Path(signal).write_text("polled")
    else:
        _wait_for(signal, "rank 0 never came back from poll")
    return {"polls": polls, "sums": [hvd.synchronize(handles[k]).item() for k in "xy"]}


def test_poll_waits_neither_for_the_peers_header_nor_for_their_offer(ranks, tmp_path):
    got = ranks(2, _both_poll_in_different_orders, str(tmp_path / "signal"))
    assert not any(got[0]["polls"]) and not any(got[1]["polls"]), got
    assert all(out["sums"] == [3.0, 3.0] for out in got), got


def _same_name_twice() -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    first = hvd.allreduce_async(torch.ones(1), name="twice", op=hvd.Sum)
    try:
        hvd.allreduce_async(torch.ones(1), name="twice")
        error = ""
    except ValueError as e:
        error = str(e)
    return {"error": error, "first": hvd.synchronize(first).item()}


def test_a_name_already_pending_on_a_rank_is_refused_there(ranks):
    for r, out in enumerate(ranks(2, _same_name_twice)):
        assert f"'twice' is already pending on rank {r}" in out["error"], out
        assert out["first"] == 2.0
