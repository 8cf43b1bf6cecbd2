"""Rank 1 fails (raises, or SIGKILLs itself) while rank 0 waits in a barrier.

Every worker, and one child process each worker starts, writes its pid into the directory given
as the first argument, so the test can check that nothing is left running afterwards.
"""

import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist


def main() -> None:
    pid_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    # A child that would outlive its worker if nobody ended it (as DataLoader workers can).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    for pid, name in ((os.getpid(), f"worker{rank}"), (child.pid, f"child{rank}")):
        with open(os.path.join(pid_dir, name), "w") as f:
            f.write(str(pid))
    dist.barrier()  # both ranks are up and have written their pids
    print(f"rank {rank} ready", flush=True)
    if rank == 1:
        time.sleep(0.5)
        if mode == "raise":
            raise ValueError("rank 1 fails on purpose")
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 waits here for a peer that never comes
    time.sleep(300)


if __name__ == "__main__":
    main()
