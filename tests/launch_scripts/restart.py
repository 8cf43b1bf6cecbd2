"""Rank 1 SIGKILLs itself on the first attempt only; the restarted job all-reduces and exits 0."""

import os
import signal

import torch
import torch.distributed as dist


def main() -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if attempt == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    print(f"RESULT attempt={attempt} rank={rank} sum={value.item():g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
