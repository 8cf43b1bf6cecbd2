"""A training script in Horovod's documented style (init, lr scaled by size, broadcast of
parameters and optimizer state, DistributedOptimizer), with one import changed to longboat's;
``--replicate`` trains the same run through ``longboat.initialize`` with strategy replicate.
Each rank trains on its slice of the same global batches. Rank 0 prints one JSON line: the
losses averaged over the ranks and the final parameters."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

import longboat
import longboat.horovod.torch as hvd

ap = argparse.ArgumentParser()
ap.add_argument("--replicate", action="store_true")
args = ap.parse_args()

hvd.init()
torch.manual_seed(hvd.rank())  # different on each rank: the broadcast must make them alike
model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
if args.replicate:
    engine = longboat.initialize(
        model, optimizer, {"strategy": "replicate", "batch": {"micro_batch_size": 8}}
    )
else:
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
g = torch.Generator().manual_seed(7)
losses = []
for _ in range(6):
    x, y = (
        torch.randn(8 * hvd.size(), 12, generator=g),
        torch.randint(0, 4, (8 * hvd.size(),), generator=g),
    )
    mine = slice(8 * hvd.rank(), 8 * (hvd.rank() + 1))
    if args.replicate:
        loss = F.cross_entropy(engine(x[mine]), y[mine])
        engine.backward(loss)
        engine.step()
    else:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        optimizer.step()
    losses.append(hvd.allreduce(loss.detach(), op=hvd.Average).item())
params = {k: v.tolist() for k, v in model.state_dict().items()}
if hvd.rank() == 0:
    print(json.dumps({"losses": losses, "params": params}))
if args.replicate:
    engine.close()
hvd.shutdown()
