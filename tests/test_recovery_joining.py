"""A replacement's admission through the store ([Note: joining a replacement]) and what it is
sent ([Note: what a joiner receives]), without processes: a HashStore stands for the
launcher's store, a group of one for the new group."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from longboat.comm.collectives import Collectives
from longboat.recovery import joining, transfer
from longboat.recovery.membership import Arrival, RecoveryError, agree


def test_members_see_a_waiting_replacement_once_and_take_it_in_after_the_next_step():
    store = dist.HashStore()
    key = joining.waiting_key(1, block=1)
    assert joining.at_boundary(store, key, 5) is None  # nobody waits: nothing written
    assert not store.check(["longboat/recovery/join/1"])
    k = joining.register(store, 4)
    assert k == 1 and joining.joiner_of(store, k) == 4
    first = joining.at_boundary(store, key, 5)  # the first member to look decides: after step 6
    assert first == 6
    assert joining.at_boundary(store, key, 6) == 6  # a member a step later reads the same
    assert joining.register(store, 7) == 2  # a second replacement waits for the next round


def _forming(store, joiners, block, **kwargs) -> dict[int, object]:
    """``form_batch`` for each (id, place) on its own thread, in order (each ticket taken
    before the next thread starts); each one's (ticket, batch, tickets) or error."""
    out: dict[int, object] = {}

    def one(id: int, place: int) -> None:
        try:
            out[id] = joining.form_batch(store, id, place, block, poll_s=0.01, **kwargs)
        except BaseException as e:  # JobEnded is a SystemExit
            out[id] = e

    threads = []
    for id, place in joiners:
        threads.append(threading.Thread(target=one, args=(id, place)))
        threads[-1].start()
        deadline = time.monotonic() + 5
        while not store.check([f"longboat/recovery/join/{len(threads)}/place"]):
            assert time.monotonic() < deadline
            time.sleep(0.005)
    for t in threads:
        t.join(10)
    return out


def test_replacements_form_whole_shard_groups_one_of_each_place_in_ticket_order():
    # Two replicas broke at once (3 of 2 ranks each): the tickets come as places 0, 0, 1, 1;
    # each fills the first batch still lacking its place, so the batches are (1, 3) and (2, 4).
    store = dist.HashStore()
    got = _forming(store, [(10, 0), (11, 0), (12, 1), (13, 1)], 2)
    assert got[10] == (1, 1, [1, 3]) and got[12] == (3, 1, [1, 3])
    assert got[11] == (2, 2, [2, 4]) and got[13] == (4, 2, [2, 4])
    assert joining.joiners_of(store, 2, block=2) == [(2, 11), (4, 13)]
    # the members look at the batch, not at a ticket: waiting once its last joiner is built
    key = joining.waiting_key(1, block=2)
    joining.built(store, 1, 2)
    assert joining.at_boundary(store, key, 7) is None
    joining.built(store, 1, 2)
    assert joining.at_boundary(store, key, 7) == 8


def test_a_replacement_whose_batch_never_fills_stops_when_the_job_ended():
    store = dist.HashStore()
    joining.current(store, [0, 1])
    joining.close(store, 0)
    joining.close(store, 1)
    got = _forming(store, [(10, 0)], 2)
    assert isinstance(got[10], joining.JobEnded) and got[10].code == 0
    assert "replacement ticket 1 was taken in" in got[10].message


def test_the_replacement_is_appended_to_the_members_that_arrived():
    store = dist.HashStore()
    for i in (0, 2):
        store.set(f"longboat/recovery/3/here/{i}", Arrival(i, 9, ((0, 40),)).to_json())
    m = agree(store, 3, (0, 2), Arrival(0, 9, ((0, 40),)), wait_s=1, joining=(4,))
    assert m.members == (0, 2, 4) and m.rank_of(4) == 2 and m.lost == ()


def test_a_waiting_replacement_stops_when_the_job_ended_or_every_member_died():
    store = dist.HashStore()
    k = joining.register(store, 5)
    joining.current(store, [0, 2])
    joining.close(store, 0)
    joining.close(store, 2)
    with pytest.raises(joining.JobEnded) as ended:
        joining.wait_admitted(store, k, poll_s=0.001)
    assert ended.value.code == 0
    store = dist.HashStore()
    k = joining.register(store, 5)
    joining.current(store, [0, 2])
    with pytest.raises(RecoveryError, match="every member of the job"):
        joining.wait_admitted(store, k, dead=lambda: {0, 2}, poll_s=0.001)
    joining.admitted(store, k, 7, [0, 2, 5])
    assert joining.wait_admitted(store, k) == 7


def test_optimizer_and_scheduler_state_travel_as_json_and_tensors_unchanged():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        sched.step()
    tensors: list[torch.Tensor] = []
    layout = transfer.encode(opt.state_dict(), tensors)
    assert all("t" in node for node, _ in transfer.layout_places(layout, torch.device("cpu")))
    back = transfer.decode(layout, [t.clone() for t in tensors])
    want = opt.state_dict()
    assert back["param_groups"] == want["param_groups"]  # tuples stay tuples: betas
    for i, st in want["state"].items():
        assert all(torch.equal(back["state"][i][k], v) for k, v in st.items())
    assert transfer.decode(transfer.encode(sched.state_dict(), []), []) == sched.state_dict()
    with pytest.raises(TypeError, match="cannot be sent to a joining rank"):
        transfer.encode({"fn": print}, [])


def test_share_on_a_group_of_one_hands_back_the_senders_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    alone = Collectives.alone(0, name="test")
    header, optim, sched, rng = transfer.share(
        alone, alone, {"counters": [1]}, [*model.parameters()], opt, None, torch.device("cpu")
    )
    assert header["counters"] == [1] and sched is None
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.equal(
        optim["state"][0]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )
