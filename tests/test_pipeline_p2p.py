"""The messages between pipeline stages ([Note: shapes on the wire] in ``pipeline/p2p.py``):
every tensor arrives whole whatever its shapes do, and a boundary of constant shape costs one
message per activation once settled; then a pipeline whose shapes change every step, against
the plain PyTorch loop."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import longboat
from longboat.mesh import Mesh
from longboat.pipeline.p2p import SETTLE, Link, Message
from longboat.topology import DoorwayOptions, Topology


class _Counting:
    """A doorway that counts the sends made through it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.sends = inner, 0

    def send(self, *args: Any, **kwargs: Any) -> Any:
        self.sends += 1
        return self.inner.send(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _tensor(i: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n) % 7 + i).reshape(shape).to(dtype)


def _exchange(
    sequence: list[tuple[int, tuple[int, ...], torch.dtype]], ahead: bool = False
) -> dict[str, Any]:
    """Rank 0 sends the activations of ``sequence`` ((boundary, shape, dtype) each); rank 1
    checks each and sends back a gradient, which rank 0 checks. Returns the messages sent.
    ``ahead``: each receive is posted ahead where it can be ([Note: receives posted ahead]):
    rank 0's gradient before it is due, rank 1's next activation before it sends a gradient."""
    topo = Topology.build(
        Mesh(pp=2), DoorwayOptions(desync_check=True, timeout_s=30), torch.device("cpu")
    )
    data, control = _Counting(topo.data("pp")), _Counting(topo.control("pp"))
    link = Link(data, control, torch.device("cpu"))  # type: ignore[arg-type]
    rank = topo.data("pp").rank
    handles: list[Any] = []
    wrong: list[int] = []
    per_message: list[tuple[int, int]] = []
    for i, (boundary, shape, dtype) in enumerate(sequence):
        act = Message("activation", i, boundary, boundary + 1)
        grad = Message("gradient", i, boundary + 1, boundary)
        before = (data.sends, control.sends)
        if rank == 0:
            sent = _tensor(i, shape, dtype)
            handles += link.send(sent, 1, act)
            if ahead:
                assert link.post(1, grad, like=sent)
            back = link.recv(1, grad, like=sent)
            want = sent if dtype == torch.bool else sent + 1  # what rank 1 sends back
            if back.shape != sent.shape or back.dtype != dtype or not torch.equal(back, want):
                wrong.append(i)
        else:
            got = link.recv(0, act)
            if (
                got.shape != shape
                or got.dtype != dtype
                or not torch.equal(got, _tensor(i, shape, dtype))
            ):
                wrong.append(i)
            if ahead and i + 1 < len(sequence):
                nxt = sequence[i + 1][0]
                link.post(0, Message("activation", i + 1, nxt, nxt + 1))  # if settled
            handles += link.send(got + 1 if dtype != torch.bool else got, 0, grad)
        per_message.append((data.sends - before[0], control.sends - before[1]))
    for h in handles:
        h.wait()
    topo.close()
    return {"wrong": wrong, "per_message": per_message}


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("ahead", [False, True])
def test_a_constant_boundary_settles_into_one_message_per_activation(ranks, ahead):
    n = SETTLE + 4
    sender, receiver = ranks(2, _exchange, [(0, (2, 5, 3), F32)] * n, ahead)
    assert sender["wrong"] == receiver["wrong"] == []
    # (data, control) messages of each activation, then of its gradient: no header
    assert sender["per_message"] == [(1, 1)] * SETTLE + [(1, 0)] * (n - SETTLE)
    assert receiver["per_message"] == [(1, 0)] * n


@pytest.mark.parametrize("ahead", [False, True])
def test_shapes_that_change_arrive_whole_and_the_stream_settles_again(ranks, ahead):
    a, b = (2, 5, 3), (3, 5, 3)
    sequence = (
        [(0, a, F32)] * (SETTLE + 1)  # settles
        + [(0, b, F32)] * (SETTLE + 1)  # a change while settled: a notice, then settles again
        + [(0, b, BF16)]  # the dtype alone changes
        + [(0, a, F32), (0, b, F32)] * 3  # changing every message: never settles
        + [(0, (4,), torch.int64), (0, (), F32), (0, (2, 2), torch.bool)]
    )
    sender, receiver = ranks(2, _exchange, sequence, ahead)  # ahead: a notice of a new shape
    assert sender["wrong"] == receiver["wrong"] == []  # lands in a receive posted for the old
    sent = [m[0] for m in sender["per_message"]]  # data messages of each activation
    headers = [m[1] for m in sender["per_message"]]
    k = SETTLE + 1
    assert headers[:k] == [1] * SETTLE + [0]
    assert sent[k] == 2 and headers[k] == 0  # the notice of the new shape, then the tensor
    assert headers[k + 1 : 2 * k] == [1] * (SETTLE - 1) + [0]
    assert sent[2 * k] == 2 and headers[2 * k] == 0  # bf16: a notice too
    assert headers[2 * k + 1 :] == [1] * (len(sequence) - 2 * k - 1)


@pytest.mark.parametrize("ahead", [False, True])
def test_two_boundaries_between_the_same_ranks_keep_their_own_shapes(ranks, ahead):
    # interleaved stages: boundaries 0 and 2 both go from rank 0 to rank 1
    sequence = [(0, (2, 3), F32), (2, (4, 1), F32)] * (SETTLE + 2) + [
        (2, (5,), F32),
        (0, (2, 3), F32),
    ]
    sender, receiver = ranks(2, _exchange, sequence, ahead)
    assert sender["wrong"] == receiver["wrong"] == []
    headers = [m[1] for m in sender["per_message"]]
    assert headers == [1] * (2 * SETTLE) + [0] * 4 + [0, 0]
    assert sender["per_message"][-2] == (2, 0)  # boundary 2's notice of its new shape, the tensor


def _send_before_due(ahead: bool) -> bool:
    """Rank 1 posts a gradient's receive ahead (or not), then waits for rank 0 to have
    finished sending it before the receive is due. Without the receive posted, rank 0's send
    cannot finish (gloo moves a message once both ends posted it): the doorway's timeout
    ends both ranks with a hang report instead."""
    topo = Topology.build(Mesh(pp=2), DoorwayOptions(timeout_s=10), torch.device("cpu"))
    data, control = topo.data("pp"), topo.control("pp")
    link = Link(data, control, torch.device("cpu"))
    grad = Message("gradient", 0, 1, 0)
    like = torch.zeros(256, 1024)  # 1 MiB
    if data.rank == 1:
        if ahead:
            assert link.post(0, grad, like=like)
        control.barrier()  # rank 0 sends now
        control.barrier()  # ... and has finished sending: only now is the receive due
        got = link.recv(0, grad, like=like)
        assert torch.equal(got, like + 3)
    else:
        control.barrier()
        for h in link.send(like + 3, 1, grad):
            h.wait()
        control.barrier()
    topo.close()
    return True


def test_a_receive_posted_ahead_lets_its_send_finish_before_it_is_due(ranks):
    """[Note: receives posted ahead]: the bytes move while the receiver is busy elsewhere."""
    assert ranks(2, _send_before_due, True) == [True, True]


# -- shapes that change every step, through the engine ------------------------------------------

VOCAB, WIDTH, M, BATCH = 11, 8, 4, 8
LENGTHS = [6, 6, 9, 4, 4, 4, 7]  # each step's sequence length


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, WIDTH),
        nn.Tanh(),
        nn.Linear(WIDTH, VOCAB),
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(VOCAB, (BATCH, t), generator=g),
            torch.randint(VOCAB, (BATCH, t), generator=g),
        )
        for t in LENGTHS
    ]


def _loss(out: torch.Tensor, mb: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), mb[1].reshape(-1))


def _pipelined(schedule: str, virtual: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pipeline: dict[str, Any] = {"schedule": schedule, "partition": "uniform"}
    if virtual > 1:
        pipeline["virtual_stages"] = virtual
    config = {
        "mesh": {"pp": 2},
        "pipeline": pipeline,
        "batch": {"train_batch_size": BATCH, "gradient_accumulation_steps": M},
        "log": {"progress": False, "level": "WARNING"},
    }
    engine = longboat.initialize(model, opt, config)
    losses = [engine.train_step(b, _loss, inputs=lambda mb: (mb[0],)) for b in _batches()]
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    engine.close()
    return {"losses": losses, "state": state}


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_a_pipeline_whose_shapes_change_every_step_equals_plain_pytorch(ranks, schedule, virtual):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want = []
    for x, y in _batches():
        total = 0.0
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = _loss(model(xm), (xm, ym))
            (loss / M).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        want.append(total / M)
    results = ranks(2, _pipelined, schedule, virtual)
    plain = model.state_dict()
    for r in results:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
        for k, v in r["state"].items():
            torch.testing.assert_close(v, plain[k], rtol=1e-5, atol=1e-6, msg=k)
    assert {k for r in results for k in r["state"]} == set(plain)
