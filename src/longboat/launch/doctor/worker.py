"""The script ``longboat doctor`` runs on every rank: join a gloo group, prove it works, and
share each rank's facts. Usage (by the doctor only): ``worker.py OUT_DIR TIMEOUT_S BACKEND``.

Nothing is printed; results go to ``OUT_DIR`` as JSON, written by each node's local rank 0
(``ranks.json``: every rank's facts) or by a rank that failed (``error-rank<N>.json``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

# Run as a script, this file's directory heads sys.path, and its siblings (local.py,
# network.py, ...) would shadow any top-level module of the same name: take it off.
if __name__ == "__main__":
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]


def _facts(backend: str) -> dict[str, object]:
    from dataclasses import asdict

    from longboat.launch.doctor import local, network
    from longboat.world import World

    world = World.from_env()
    net = network.gather(world.master_addr)
    used, _ = network.backend_interface(backend, os.environ, net)
    return {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "node_rank": world.node_rank,
        "host": socket.gethostname(),
        "versions": local.versions(),
        "backends": asdict(local.backends()),
        "interface": used,
    }


def _all_reduce_check(world_size: int) -> tuple[bool, float]:
    """Sum rank+1 over all ranks; True when it equals n(n+1)/2. Also the time of a second call
    (the first one sets up connections)."""
    import torch
    import torch.distributed as dist

    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    ok = x.item() == world_size * (world_size + 1) / 2
    y = torch.ones(1)
    t0 = time.perf_counter()
    dist.all_reduce(y)
    ms = (time.perf_counter() - t0) * 1000
    return ok and y.item() == world_size, ms


def main(argv: list[str]) -> int:
    out, timeout_s, backend = Path(argv[1]), float(argv[2]), argv[3]
    from longboat.checkpoint.exchange import gather_json
    from longboat.comm.collectives import Collectives
    from longboat.world import World, destroy_process_group, init_process_group

    world = World.from_env()
    try:
        facts = _facts(backend)
        # Always gloo: the check is that the ranks meet over TCP; it runs on any machine.
        init_process_group(world, backend="gloo", timeout_s=timeout_s)
        ok, ms = _all_reduce_check(world.world_size)
        facts["all_reduce_ok"], facts["all_reduce_ms"] = ok, round(ms, 3)
        every = gather_json(Collectives(), facts)
    except Exception as e:  # reported by the doctor as a finding, not as a traceback
        (out / f"error-rank{world.rank}.json").write_text(
            json.dumps({"rank": world.rank, "error": f"{type(e).__name__}: {e}"})
        )
        return 1
    finally:
        destroy_process_group()
    if world.local_rank == 0:
        tmp = out / f"ranks.json.{world.rank}"
        tmp.write_text(json.dumps(every))
        tmp.replace(out / "ranks.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
