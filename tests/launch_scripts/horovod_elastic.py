"""A script in Horovod's elastic style (``@hvd.elastic.run``, ``TorchState``, ``commit()``
every 5 batches). ``--crash-at B``: on the first attempt, rank 1 dies after batch B. Rank 0
prints one JSON line: the batches this attempt ran and the final parameters."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import longboat.horovod.torch as hvd

ap = argparse.ArgumentParser()
ap.add_argument("--crash-at", type=int, default=-1)
args = ap.parse_args()

hvd.init()
torch.manual_seed(hvd.rank())  # different on each rank: the state's sync must make them alike
model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
    named_parameters=model.named_parameters(),
)
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> list[int]:
    ran = []
    while state.batch < 20:
        b = state.batch
        g = torch.Generator().manual_seed(1000 + b)  # batch b is the same whenever it runs
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        mine = slice(4 * hvd.rank(), 4 * (hvd.rank() + 1))
        optimizer.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
        ran.append(b)
        state.batch = b + 1
        if state.batch % 5 == 0:
            state.commit()
        if attempt == 0 and hvd.rank() == 1 and b == args.crash_at:
            os._exit(1)
    return ran


ran = train(hvd.elastic.TorchState(model, optimizer, batch=0))
if hvd.rank() == 0:
    params = {k: v.tolist() for k, v in model.state_dict().items()}
    print(json.dumps({"attempt": attempt, "ran": ran, "params": params}), flush=True)
hvd.shutdown()
