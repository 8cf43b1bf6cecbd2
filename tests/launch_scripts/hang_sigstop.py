"""Ranks train a few steps; then the last rank stops itself (SIGSTOP), or dies (argv[3] ==
"exit"), before an all_reduce.

argv: timeout_s out_dir [stop|exit]. Each survivor writes the time it entered the collective.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch

import longboat

timeout_s, out = float(sys.argv[1]), Path(sys.argv[2])
model = torch.nn.Linear(4, 4)
engine = longboat.initialize(
    model,
    torch.optim.SGD(model.parameters(), lr=0.1),
    {"batch": {"micro_batch_size": 2}, "comm": {"timeout_s": timeout_s}},
)
out.joinpath(f"pid{engine.comm.rank}").write_text(str(os.getpid()))
for _ in range(2):
    engine.backward(engine(torch.ones(2, 4)).sum())  # LAST AGREED: its bucket's all-reduce
    engine.step()
flag = torch.ones(1)
if engine.comm.rank == engine.comm.world_size - 1:
    if sys.argv[3:] == ["exit"]:
        os._exit(3)
    os.kill(os.getpid(), signal.SIGSTOP)
out.joinpath(f"entered{engine.comm.rank}").write_text(repr(time.time()))
engine.comm.all_reduce(flag)  # WAIT HERE: the others wait in this collective
print("not reached", flush=True)
