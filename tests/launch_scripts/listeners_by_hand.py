"""Started by hand with a Slurm-like environment (no launcher): join through longboat.world,
all_reduce, then print this process's TCP listeners as ``LISTEN addr:port``."""

import psutil
import torch
import torch.distributed as dist

from longboat.world import World, destroy_process_group, init_process_group

world = World.from_env()
init_process_group(world, backend="gloo", timeout_s=60)
value = torch.tensor([float(world.rank + 1)])
dist.all_reduce(value)
print(f"SUM {value.item():g}", flush=True)
for c in psutil.Process().net_connections(kind="tcp"):
    if c.status == psutil.CONN_LISTEN:
        print(f"LISTEN {c.laddr.ip}:{c.laddr.port}", flush=True)
dist.barrier()  # nobody leaves while another still lists
destroy_process_group()
