"""A training script in DeepSpeed's documented style (argparse with its config flags,
``deepspeed.initialize``, ``backward``/``step``, ``save_checkpoint``/``load_checkpoint``), with
one import changed to longboat's; ``--plain-longboat`` trains the same run through
``longboat.initialize`` instead. Rank 0 prints one JSON line: the losses, the final parameters'
digest, and what load_checkpoint returned."""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import longboat
import longboat.deepspeed as deepspeed


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


parser = argparse.ArgumentParser()
parser.add_argument("--checkpoints", required=True)
parser.add_argument("--plain-longboat", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(128, 20, generator=g), torch.randint(0, 5, (128,), generator=g))
net = Net()
if args.plain_longboat:
    engine = longboat.initialize(net, None, args.deepspeed_config)
    loader, rank = engine.loader(data), engine.world.rank
else:
    engine, optimizer, loader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=data
    )
    rank = engine.global_rank
losses = []
for x, y in loader:
    loss = F.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
loaded = None
if not args.plain_longboat:
    engine.save_checkpoint(args.checkpoints, client_state={"epoch": 1})
    path, client = engine.load_checkpoint(args.checkpoints)
    loaded = {
        "tag": path.rsplit("/", 1)[-1],
        "client": client,
        "steps": engine.global_steps,
        "lr": engine.get_lr(),
        "batch": [
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ],
        "stage": engine.zero_optimization_stage(),
    }
state = engine.module.state_dict() if not args.plain_longboat else engine.state_dict()
digest = hashlib.sha256()
for _, v in sorted(state.items()):
    digest.update(v.detach().contiguous().numpy().tobytes())
if rank == 0:
    print(json.dumps({"losses": losses, "digest": digest.hexdigest(), "loaded": loaded}))
