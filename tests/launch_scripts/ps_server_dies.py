"""A sync parameter-server job on digits (2 workers, 1 server) that checkpoints every 10 steps
into ``argv[1]`` and resumes from the latest checkpoint there; in the first attempt the server's
optimizer kills its process at its 25th step. Prints where it resumed and where it finished."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

import longboat
from longboat.models import DigitsCNN

STEPS, EVERY, DIE_AT = 40, 10, 25


class FragileAdamW(torch.optim.AdamW):
    """AdamW whose process dies at its DIE_AT-th step in the first attempt (it steps on the
    server only: the workers' optimizer never steps with update_on_server)."""

    longboat_elementwise = True  # AdamW's update, per element

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        out = super().step(closure)
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == DIE_AT and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return out


directory = Path(sys.argv[1])
torch.set_num_threads(1)
x, y = load_digits(return_X_y=True)
data = TensorDataset(torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(y))
longboat.seed_everything(0)
model = DigitsCNN()
config = {
    "strategy": "parameter_server",
    "parameter_server": {"servers": 1, "mode": "sync"},
    "batch": {"train_batch_size": 32},
    "log": {"progress": False},
}
engine = longboat.initialize(model, FragileAdamW(model.parameters(), lr=1e-3), config)
if directory.exists():
    engine.load_checkpoint(directory)
    print(f"resumed at step {engine.global_step}", flush=True)
while engine.global_step < STEPS:
    for xb, yb in engine.loader(data):
        engine.backward(torch.nn.functional.cross_entropy(engine(xb), yb))
        if engine.step() and engine.global_step % EVERY == 0:
            engine.save_checkpoint(directory)
        if engine.global_step == STEPS:
            break
print(f"finished at step {engine.global_step}", flush=True)
engine.close()
