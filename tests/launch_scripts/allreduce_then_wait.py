"""One gloo all_reduce with a short timeout, then a pause (for `ss`), then another all_reduce.

``--wait S`` pauses S seconds between the two; ``--fail-rank R`` exits 3 on rank R after the
first all_reduce. Prints ``RESULT rank=.. world_size=.. sum=.. ifname=..`` per all_reduce.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wait", type=float, default=0.0)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    for i in range(2):
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        print(
            f"RESULT rank={rank} world_size={dist.get_world_size()} sum={value.item():g} "
            f"ifname={os.environ.get('GLOO_SOCKET_IFNAME')}",
            flush=True,
        )
        if i == 0:
            if rank == args.fail_rank:
                print(f"rank {rank} fails on purpose", file=sys.stderr, flush=True)
                # _exit: leaving through interpreter shutdown with gloo's threads running can
                # abort (SIGABRT, "terminate called without an active exception").
                os._exit(3)
            print(f"WAITING rank={rank}", flush=True)
            time.sleep(args.wait)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
