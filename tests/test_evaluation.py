"""Exact distributed evaluation ([Note: exact evaluation]): over a dataset that does not divide
by the world size, every sample is counted once at 1, 2 and 4 ranks (``DistributedSampler``
counts some twice), under ``replicate`` and under ZeRO-3, whose forwards are collective."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

N = 19  # divides by neither 2 nor 4; at 4 ranks, shares of 5, 5, 5 and 4


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g))


def _evaluate(strategy: str) -> dict:
    import longboat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    cfg = {
        "strategy": strategy,
        "zero": {"stage": 3, "unit_min_params": 10},
        "batch": {"micro_batch_size": 4},
        "log": {"progress": False},
    }
    engine = longboat.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    loader = engine.eval_loader(_data(), batch_size=2)
    seen, loss, correct, empty = [], 0.0, 0, 0
    engine.eval()
    with torch.no_grad():
        for x, y in loader:
            out = engine(x)
            loss += torch.nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct += int((out.argmax(1) == y).sum())
            seen += [float(v) for v in x[:, 0]]
            empty += len(x) == 0
    total = engine.reduce_metrics({"loss": loss, "correct": correct, "count": len(seen)})
    padded = len(list(DistributedSampler(_data(), engine.world.world_size, engine.world.rank)))
    out = {
        "total": total,
        "seen": seen,
        "batches": len(loader),
        "padded": padded,
        "empty": empty,
    }
    engine.close()
    return out


def _plain() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = _data().tensors
    with torch.no_grad():
        out = model(x)
    return {
        "loss": torch.nn.functional.cross_entropy(out, y, reduction="sum").item(),
        "correct": int((out.argmax(1) == y).sum()),
        "count": N,
    }


@pytest.mark.parametrize("strategy", ["replicate", "zero"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_sample_is_counted_once(ranks, world, strategy):
    got = ranks(world, _evaluate, strategy)
    want = _plain()
    seen = sorted(v for r in got for v in r["seen"])
    assert seen == sorted(float(v) for v in _data().tensors[0][:, 0])  # each sample once
    assert len({r["batches"] for r in got}) == 1  # every rank as many batches
    for r in got:
        assert r["total"]["count"] == N and r["total"]["correct"] == want["correct"]
        assert r["total"]["loss"] == pytest.approx(want["loss"], rel=1e-6)
    if world > 1:  # what DistributedSampler would have counted
        assert sum(r["padded"] for r in got) > N
    if world == 4:  # rank 3's share ended a batch early: it ran an empty one, in step
        assert [r["empty"] for r in got] == [0, 0, 0, 1]
