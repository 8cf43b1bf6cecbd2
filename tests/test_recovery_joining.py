"""A replacement's admission through the store ([Note: joining a replacement]) and what it is
sent ([Note: what a joiner receives]), without processes: a HashStore stands for the
launcher's store, a group of one for the new group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from longboat.comm.collectives import Collectives
from longboat.recovery import joining, transfer
from longboat.recovery.membership import Arrival, RecoveryError, agree


def test_members_see_a_waiting_replacement_once_and_take_it_in_after_the_next_step():
    store = dist.HashStore()
    assert joining.at_boundary(store, 1, 5) is None  # nobody waits: nothing written
    assert not store.check(["longboat/recovery/join/1"])
    k = joining.register(store, 4)
    assert k == 1 and joining.joiner_of(store, k) == 4
    first = joining.at_boundary(store, 1, 5)  # the first member to look decides: after step 6
    assert first == 6
    assert joining.at_boundary(store, 1, 6) == 6  # a member a step later reads the same
    assert joining.register(store, 7) == 2  # a second replacement waits for the next round


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
        alone, alone, {"counters": [1]}, model, opt, None, torch.device("cpu")
    )
    assert header["counters"] == [1] and sched is None
    assert torch.equal(rng, torch.get_rng_state())
    assert torch.equal(
        optim["state"][0]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"]
    )
