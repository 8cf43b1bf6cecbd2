"""Rank 1 exits with status 3 on every attempt; every worker notes its attempt in a file."""

import os
import sys
import time


def main() -> None:
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    rank = int(os.environ["RANK"])
    with open(os.path.join(sys.argv[1], f"attempt{attempt}-rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(0.2)
        sys.exit(3)
    time.sleep(60)  # rank 0 would go on; the launcher stops it when rank 1 fails


if __name__ == "__main__":
    main()
