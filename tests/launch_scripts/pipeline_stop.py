"""Two pipeline stages train two steps; then stage 0 stops itself (SIGSTOP) before the third,
and stage 1 waits to receive its activation.

argv: timeout_s out_dir. Each rank writes its pid; stage 1 writes the time it began the step.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

import longboat

timeout_s, out = float(sys.argv[1]), Path(sys.argv[2])
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
engine = longboat.initialize(
    model,
    torch.optim.SGD(model.parameters(), lr=0.1),
    {
        "mesh": {"pp": 2},
        "batch": {"train_batch_size": 4, "gradient_accumulation_steps": 2},
        "comm": {"timeout_s": timeout_s},
    },
)
rank = engine.world.rank
out.joinpath(f"pid{rank}").write_text(str(os.getpid()))
batch = (torch.ones(4, 4), torch.zeros(4, dtype=torch.long))


def loss_fn(y: torch.Tensor, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(y, mb[1])


for _ in range(2):
    engine.train_step(batch, loss_fn)
if rank == 0:
    os.kill(os.getpid(), signal.SIGSTOP)
out.joinpath(f"entered{rank}").write_text(repr(time.time()))
engine.train_step(batch, loss_fn)  # stage 1 waits here for stage 0's activation
print("not reached", flush=True)
