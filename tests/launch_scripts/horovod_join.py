"""A training script in Horovod's documented style for uneven data: rank ``--short`` has 3
batches fewer than the others; each rank steps every ``--bpps`` backward passes (and once more
for a last partial accumulation), averages its step's loss with ``hvd.allreduce``, then calls
``hvd.join()`` and takes the parameters of the rank that joined last. Each rank prints one JSON
line: its own losses, the averaged step losses, the joined-last rank and its final parameters."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import longboat.horovod.torch as hvd


def batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``i``-th batch (the test's reference builds the same)."""
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def train(batches: int, short: int, bpps: int) -> dict:
    hvd.init()
    torch.manual_seed(hvd.rank())  # different on each rank: the broadcast makes them alike
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=bpps
    )
    mine = batches - 3 if hvd.rank() == short else batches
    losses, averaged, step_loss = [], [], 0.0
    for i in range(mine):
        x, y = batch(hvd.rank(), i)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        step_loss += loss.item()
        if (i + 1) % bpps == 0 or i + 1 == mine:
            optimizer.step()
            optimizer.zero_grad()
            averaged.append(hvd.allreduce(torch.tensor(step_loss, dtype=torch.float64)).item())
            step_loss = 0.0
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    params = {k: v.tolist() for k, v in model.state_dict().items()}
    return {"rank": hvd.rank(), "losses": losses, "averaged": averaged, "last": last,
            "params": params}  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--short", type=int, default=1)
    ap.add_argument("--bpps", type=int, default=1)
    args = ap.parse_args()
    print(json.dumps(train(args.batches, args.short, args.bpps)))
    hvd.shutdown()
