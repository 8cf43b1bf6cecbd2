"""Rank 1 fails; rank 0, whose barrier then fails, takes a moment before it says why and exits
([Note: last words] in longboat/launch/last_words.py). At three ranks, rank 2 is not in that
barrier: it sleeps, and the launcher must stop it."""

import os
import sys
import time

import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    dist.barrier()
    if rank == 1:
        print("rank 1 fails on purpose", file=sys.stderr, flush=True)
        os._exit(1)  # at once: its peers notice as its launcher does
    if rank == 2:
        time.sleep(300)
    try:
        dist.barrier()
    except Exception as e:
        time.sleep(0.4)  # a rank slow to speak, as on a loaded machine
        print(f"rank {rank} lost its peer: {e}", file=sys.stderr, flush=True)
        # _exit: leaving through interpreter shutdown with gloo's threads running can abort.
        os._exit(1)


if __name__ == "__main__":
    main()
