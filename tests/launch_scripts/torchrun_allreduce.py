"""A script written for torchrun: reads the torchrun environment and sets up gloo itself."""

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    assert os.environ["MASTER_ADDR"] and os.environ["MASTER_PORT"]
    dist.init_process_group("gloo")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(
        f"RESULT rank={rank} local_rank={local_rank} world_size={world_size} "
        f"sum={value.item():g} omp={os.environ.get('OMP_NUM_THREADS')} args={sys.argv[1:]}",
        flush=True,
    )
    print(f"STDERR rank={rank}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
