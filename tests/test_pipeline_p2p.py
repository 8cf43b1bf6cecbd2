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


def _exchange(sequence: list[tuple[int, tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    """Rank 0 sends the activations of ``sequence`` ((boundary, shape, dtype) each); rank 1
    checks each and sends back a gradient, which rank 0 checks. Returns the messages sent."""
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
            handles += link.send(got + 1 if dtype != torch.bool else got, 0, grad)
        per_message.append((data.sends - before[0], control.sends - before[1]))
    for h in handles:
        h.wait()
    topo.close()
    return {"wrong": wrong, "per_message": per_message}


F32, BF16 = torch.float32, torch.bfloat16


def test_a_constant_boundary_settles_into_one_message_per_activation(ranks):
    n = SETTLE + 4
    sender, receiver = ranks(2, _exchange, [(0, (2, 5, 3), F32)] * n)
    assert sender["wrong"] == receiver["wrong"] == []
    # (data, control) messages of each activation, then of its gradient: no header
    assert sender["per_message"] == [(1, 1)] * SETTLE + [(1, 0)] * (n - SETTLE)
    assert receiver["per_message"] == [(1, 0)] * n


def test_shapes_that_change_arrive_whole_and_the_stream_settles_again(ranks):
    a, b = (2, 5, 3), (3, 5, 3)
    sequence = (
        [(0, a, F32)] * (SETTLE + 1)  # settles
        + [(0, b, F32)] * (SETTLE + 1)  # a change while settled: a notice, then settles again
        + [(0, b, BF16)]  # the dtype alone changes
        + [(0, a, F32), (0, b, F32)] * 3  # changing every message: never settles
        + [(0, (4,), torch.int64), (0, (), F32), (0, (2, 2), torch.bool)]
    )
    sender, receiver = ranks(2, _exchange, sequence)
    assert sender["wrong"] == receiver["wrong"] == []
    sent = [m[0] for m in sender["per_message"]]  # data messages of each activation
    headers = [m[1] for m in sender["per_message"]]
    k = SETTLE + 1
    assert headers[:k] == [1] * SETTLE + [0]
    assert sent[k] == 2 and headers[k] == 0  # the notice of the new shape, then the tensor
    assert headers[k + 1 : 2 * k] == [1] * (SETTLE - 1) + [0]
    assert sent[2 * k] == 2 and headers[2 * k] == 0  # bf16: a notice too
    assert headers[2 * k + 1 :] == [1] * (len(sequence) - 2 * k - 1)


def test_two_boundaries_between_the_same_ranks_keep_their_own_shapes(ranks):
    # interleaved stages: boundaries 0 and 2 both go from rank 0 to rank 1
    sequence = [(0, (2, 3), F32), (2, (4, 1), F32)] * (SETTLE + 2) + [
        (2, (5,), F32),
        (0, (2, 3), F32),
    ]
    sender, receiver = ranks(2, _exchange, sequence)
    assert sender["wrong"] == receiver["wrong"] == []
    headers = [m[1] for m in sender["per_message"]]
    assert headers == [1] * (2 * SETTLE) + [0] * 4 + [0, 0]
    assert sender["per_message"][-2] == (2, 0)  # boundary 2's notice of its new shape, the tensor


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
