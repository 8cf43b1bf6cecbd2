"""``hvd.DistributedOptimizer``'s arguments against a plain PyTorch loop, at 2 and 3 ranks: ``op``
(Average, Sum), ``gradient_predivide_factor``, ``backward_passes_per_step`` (gradients summed
over the passes, as Horovod does), ``Compression.fp16``; and Horovod's checks of
``named_parameters``. The reference imports nothing from longboat: one model, each rank's
gradient computed in turn from the same batches, combined as Horovod documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

STEPS = 3


def _batch(r: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * r + 10 * step + k)
    return torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2))


def _train(op: str, predivide: float, bpps: int, fp16: bool) -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        op=getattr(hvd, op),
        gradient_predivide_factor=predivide,
        backward_passes_per_step=bpps,
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none,
    )
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        for k in range(bpps):
            x, y = _batch(r, step, k)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def _reference(n: int, op: str, bpps: int, fp16: bool) -> dict:
    """Plain PyTorch: each rank's gradient (summed over its passes), summed over the ranks
    (in float16 with fp16 compression), divided by ``n`` for Average."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses: list[list[float]] = [[] for _ in range(n)]
    for step in range(STEPS):
        per_rank = []
        for r in range(n):
            model.zero_grad()
            for k in range(bpps):
                x, y = _batch(r, step, k)
                loss = F.mse_loss(model(x), y)
                loss.backward()
                losses[r].append(loss.item())
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            grads = [g[i].half() if fp16 else g[i] for g in per_rank]
            total = sum(grads[1:], grads[0]).float()
            p.grad = total / n if op == "Average" else total
        opt.step()
    return {"losses": losses, "params": model.state_dict()}


CONFIGS = [
    ("Average", 1.0, 1, False),
    ("Sum", 1.0, 1, False),
    ("Average", 4.0, 1, False),  # predivide: 1/4 before the sum, 4/n after it
    ("Average", 1.0, 2, False),
    ("Average", 1.0, 1, True),
]


@pytest.mark.parametrize("n", [2, 3])
def test_distributed_optimizer_arguments_train_as_plain_pytorch(ranks, n):
    for op, predivide, bpps, fp16 in CONFIGS:
        want = _reference(n, op, bpps, fp16)
        tol = 2e-3 if fp16 else 1e-5  # fp16: the sum of three rounds differently by order
        for r, got in enumerate(ranks(n, _train, op, predivide, bpps, fp16)):
            assert got["losses"] == pytest.approx(want["losses"][r], rel=tol), (op, predivide, r)
            for k, v in want["params"].items():
                err = (got["params"][k] - v).abs().max() / v.abs().max()
                assert err <= tol, (op, predivide, bpps, fp16, r, k, float(err))


def test_named_parameters_and_predivide_are_checked_as_horovod_checks_them():
    import longboat.horovod.torch as hvd

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="does not name 1 of the optimizer's parameters"):
        hvd.DistributedOptimizer(opt, named_parameters=named[:-1])
    with pytest.raises(ValueError, match=r"must be unique; duplicates: \['w'\]"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", p) for _, p in named])
    with pytest.raises(ValueError, match="sequence of \\(name, parameter\\) tuples"):
        hvd.DistributedOptimizer(opt, named_parameters=[p for _, p in named])
    with pytest.raises(ValueError, match=r"gradient_predivide_factor=2\.0 needs op=hvd\.Average"):
        hvd.DistributedOptimizer(opt, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step=0"):
        hvd.DistributedOptimizer(opt, backward_passes_per_step=0)
