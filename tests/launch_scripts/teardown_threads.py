"""Join the job as ``longboat.world`` does, build an optimizer (torch imports its compiler then),
reduce once, leave the group, and print the gloo worker threads still running:
``GLOO_THREADS n``."""

import os

import torch
import torch.distributed as dist

from longboat.world import World, destroy_process_group, init_process_group


def gloo_threads() -> int:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


if __name__ == "__main__":
    init_process_group(World.from_env())
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    v = torch.ones(2)
    dist.all_reduce(v)
    alive = gloo_threads()
    destroy_process_group()
    print(f"SUM {v[0].item():g} RUNNING {alive} GLOO_THREADS {gloo_threads()}", flush=True)
