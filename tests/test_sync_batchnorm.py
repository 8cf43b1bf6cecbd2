"""``sync_batchnorm = true`` ([Note: sync batchnorm]): at 2 and 4 ranks on CPU, under
``replicate`` and ZeRO-2, training equals plain batch norm on the union of the ranks' samples in
one process (every step's loss, then parameters and running statistics), with a momentum and
with the cumulative average; eval mode and one rank are plain batch norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

STEPS, PER_RANK = 4, 3


class Net(nn.Module):
    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4, momentum=momentum)
        self.fc = nn.Linear(4 * 5 * 5, 6)
        self.bn1 = nn.BatchNorm1d(6, momentum=momentum, affine=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn2(self.conv(x)))
        return self.head(torch.relu(self.bn1(self.fc(h.flatten(1)))))


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    n = PER_RANK * world
    return [
        (torch.randn(n, 2, 5, 5, generator=g) * 3 + 1, torch.randint(0, 3, (n,), generator=g))
        for _ in range(STEPS)
    ]


def _distributed(strategy: str, momentum: float | None, world: int) -> dict:
    import longboat

    torch.manual_seed(0)
    net = Net(momentum)
    cfg = {
        "strategy": strategy,
        "zero": {"stage": 2},
        "sync_batchnorm": True,
        "batch": {"micro_batch_size": PER_RANK},
        "log": {"progress": False},
    }
    engine = longboat.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), cfg)
    r = engine.world.rank
    losses = []
    for x, y in _batches(world):
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        loss = nn.functional.cross_entropy(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(engine.reduce_metrics({"l": loss.item()})["l"] / world)
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    engine.eval()
    with torch.no_grad():
        evaluated = engine(_batches(world)[0][0][mine]).clone()
    engine.close()
    return {"losses": losses, "state": state, "eval": evaluated, "kind": type(net.bn2).__name__}


def _plain(momentum: float | None, world: int) -> dict:
    torch.manual_seed(0)
    net = Net(momentum)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for x, y in _batches(world):
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    net.eval()
    with torch.no_grad():
        evaluated = net(_batches(world)[0][0])
    return {"losses": losses, "state": net.state_dict(), "eval": evaluated}


@pytest.mark.parametrize(
    ("strategy", "momentum", "world"),
    [("replicate", 0.1, 2), ("zero", None, 2), ("replicate", 0.3, 4)],
)
def test_synchronised_batch_norm_equals_batch_norm_on_the_union(ranks, strategy, momentum, world):
    got = ranks(world, _distributed, strategy, momentum, world)
    want = _plain(momentum, world)
    for step, plain in enumerate(want["losses"]):
        assert got[0]["losses"][step] == pytest.approx(plain, rel=1e-5), step
    for r, res in enumerate(got):
        assert res["kind"] == "SyncBatchNorm"
        for k, v in want["state"].items():
            if v.is_floating_point():
                scale = max(float(v.abs().max()), 1e-6)
                assert float((res["state"][k] - v).abs().max()) <= 1e-5 * scale, (r, k)
            else:
                assert torch.equal(res["state"][k], v), (r, k)
        # eval mode: plain batch norm with the (equal) running statistics
        rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
        assert torch.allclose(res["eval"], want["eval"][rows], atol=1e-5)


def test_on_one_rank_it_is_plain_batch_norm(ranks):
    got = ranks(1, _distributed, "replicate", 0.1, 1)[0]
    want = _plain(0.1, 1)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
