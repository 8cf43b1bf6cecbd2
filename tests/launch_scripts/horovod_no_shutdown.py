"""A Horovod-style script that never calls ``hvd.shutdown()``: after every exit handler (this
script's own runs last, being registered before ``hvd.init``) it prints the gloo worker threads
still running, ``GLOO_THREADS_AT_EXIT n``."""

import atexit
import os

import torch

import longboat.horovod.torch as hvd


def report() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    alive = sum(name.startswith(("pt_gloo", "gloo_")) for name in names)
    print(f"GLOO_THREADS_AT_EXIT {alive}", flush=True)


atexit.register(report)
hvd.init()
model = torch.nn.Linear(3, 2)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
model(torch.ones(4, 3)).sum().backward()
optimizer.step()
print(f"STEPPED rank={hvd.rank()}", flush=True)
