"""An async parameter-server job on digits in which worker ``--die-rank`` (-1: every worker)
SIGKILLs itself (``--die-how raise``: raises) after ``--die-at`` steps; the others finish and
print their step count and accuracy."""

from __future__ import annotations

import argparse
import os
import signal

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

import longboat
import longboat.ps
from longboat.models import DigitsCNN

ap = argparse.ArgumentParser()
ap.add_argument("--die-rank", type=int, default=1, help="-1: every worker")
ap.add_argument("--die-at", type=int, default=20)
ap.add_argument("--die-how", choices=("kill", "raise"), default="kill")
ap.add_argument("--epochs", type=int, default=4)
args = ap.parse_args()
torch.set_num_threads(1)  # four processes share the machine

x, y = load_digits(return_X_y=True)
x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
xtr, xte, ytr, yte = train_test_split(x, torch.tensor(y), test_size=0.2, random_state=0, stratify=y)
longboat.seed_everything(0)
model = DigitsCNN()
config = {
    "strategy": "parameter_server",
    "parameter_server": {"servers": 1, "mode": "async", "heartbeat_s": 0.2, "dead_after_s": 2.0},
    "batch": {"train_batch_size": 96},
    "data": {"remainder": "drop"},
    "log": {"progress": False},
}
engine = longboat.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), config)
rank = engine.world.rank
for _ in range(args.epochs):
    for xb, yb in engine.loader(TensorDataset(xtr, ytr)):
        engine.backward(torch.nn.functional.cross_entropy(engine(xb), yb))
        engine.step()
        if args.die_rank in (rank, -1) and engine.global_step == args.die_at:
            if args.die_how == "raise":  # the engine's exit handler still runs
                raise RuntimeError(f"rank {rank} fails at step {args.die_at}")
            os.kill(os.getpid(), signal.SIGKILL)
engine.eval()
with torch.no_grad():
    accuracy = (engine(xte).argmax(1) == yte).float().mean().item()
print(f"rank {rank} steps={engine.global_step} accuracy={accuracy:.4f}", flush=True)
engine.close()
