"""ZeRO-3 with its parameters, gradients and optimizer state on disk (argv[2]) on digits,
checkpointing every 5 steps into argv[1] and resuming from the latest there. With ``--crash``,
rank 1 SIGKILLs itself in the first attempt in the middle of step 8's optimizer step, after some
units' parameters and state were rewritten.
Prints where it resumed, and at the end a digest of the parameters."""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import longboat
from longboat.models import DigitsCNN

STEPS, EVERY, CRASH_AT = 12, 5, 8

ap = argparse.ArgumentParser()
ap.add_argument("checkpoints", type=Path)
ap.add_argument("swap", type=Path)
ap.add_argument("--crash", action="store_true")
args = ap.parse_args()
torch.set_num_threads(1)
x, y = load_digits(return_X_y=True)
data = TensorDataset(torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(y))
longboat.seed_everything(0)
model = DigitsCNN()
config = {
    "strategy": "zero",
    "zero": {
        "stage": 3,
        "unit_min_params": 100,  # each layer a unit, so the crash falls between two of them
        "offload_optimizer": {"device": "disk", "path": str(args.swap)},
        "offload_param": {"device": "disk", "path": str(args.swap)},
    },
    "batch": {"train_batch_size": 32},
    "log": {"progress": False},
}
engine = longboat.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if args.crash and first_attempt and engine.world.rank == 1:
    stream = engine.strategy.home.stream
    units = stream.units
    step_of = stream.step

    def dying_step(optimizer, step_unit):  # type: ignore[no-untyped-def]
        def one(u):  # type: ignore[no-untyped-def]
            step_unit(u)
            if engine.global_step == CRASH_AT - 1 and u is units[len(units) // 2]:
                os.kill(os.getpid(), signal.SIGKILL)

        step_of(optimizer, one)

    stream.step = dying_step
if args.checkpoints.exists():
    engine.load_checkpoint(args.checkpoints)
    print(f"resumed at step {engine.global_step}", flush=True)
while engine.global_step < STEPS:
    for xb, yb in engine.loader(data):
        engine.backward(torch.nn.functional.cross_entropy(engine(xb), yb))
        if engine.step() and engine.global_step % EVERY == 0:
            engine.save_checkpoint(args.checkpoints)
        if engine.global_step == STEPS:
            break
digest = hashlib.sha256()
for _, v in sorted(engine.state_dict().items()):
    digest.update(v.detach().contiguous().numpy().tobytes())
print(f"finished at step {engine.global_step} digest {digest.hexdigest()[:16]}", flush=True)
engine.close()
