"""Train a tiny model step after step (``STEP n`` every 10 steps) until a collective fails,
e.g. because a host's link was cut; argv: comm.timeout_s."""

import sys
import time

import torch

import longboat

model = torch.nn.Linear(4, 4)
engine = longboat.initialize(
    model,
    torch.optim.SGD(model.parameters(), lr=0.01),
    {"batch": {"micro_batch_size": 2}, "comm": {"timeout_s": float(sys.argv[1])}},
)
deadline = time.monotonic() + 120
step = 0
while time.monotonic() < deadline:
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    if step % 10 == 0:
        print(f"STEP {step}", flush=True)
    step += 1
    time.sleep(0.01)
