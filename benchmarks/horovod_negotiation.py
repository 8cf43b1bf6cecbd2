"""What Horovod's mismatch check costs: a Horovod-style training step at 2 ranks with the
exchange of [Note: Horovod negotiation] (src/longboat/horovod/negotiate.py) and without it.

Each rank trains the digits CNN (:class:`longboat.models.DigitsCNN`) on random 8x8 images with
``hvd.DistributedOptimizer`` plus one ``hvd.allreduce`` of the loss per step (two rounds per
step, each one exchange). ``checked`` is the library as it is; ``vote`` replaces the exchange
with what the module did before the check (one all-reduce of ``2 * size + 10`` int64s, the join
vote, which could not name a mismatch); ``unchecked`` replaces it with nothing (the request is
still built, a few microseconds). The arms rotate round by round, so drift in the machine's
load hits all alike. A round's time is the slowest rank's mean step time
over ``--steps`` steps; the report gives each arm's median over ``--repeats`` rounds and the
median of the per-round ratios.

Usage::

    python benchmarks/horovod_negotiation.py                        # 100 steps x 7 rounds
    python benchmarks/horovod_negotiation.py --steps 10 --repeats 1 # a quick check

Writes ``benchmarks/results/horovod_negotiation.json`` (``--out`` to change) and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import free_port, join_loopback, machine, versions

ARMS = ("checked", "vote", "unchecked")


def _round(steps: int, model: torch.nn.Module, opt: object, hvd: object) -> float:
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()  # type: ignore[attr-defined]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # type: ignore[attr-defined]
        hvd.allreduce(loss.detach())  # type: ignore[attr-defined]
    mine = torch.tensor([(time.perf_counter() - start) / steps])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def _worker(rank: int, port: int, args: argparse.Namespace, out: dict[str, list[float]]) -> None:
    join_loopback(rank, 2, port, threads=1)
    import longboat.horovod.torch as hvd
    from longboat.horovod import collectives
    from longboat.models import DigitsCNN

    hvd.init()
    torch.manual_seed(0)
    model = DigitsCNN()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    checked = collectives._announce

    def vote(*_: object) -> None:
        dist.all_reduce(torch.zeros(2 * dist.get_world_size() + 10, dtype=torch.int64))

    arms = {"checked": checked, "vote": vote, "unchecked": lambda *_: None}
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    _round(5, model, opt, hvd)  # warm-up
    for i in range(args.repeats):
        for arm in ARMS[i % 3 :] + ARMS[: i % 3]:
            collectives._announce = arms[arm]
            times[arm].append(_round(args.steps, model, opt, hvd))
    collectives._announce = checked
    if rank == 0:
        out.update(times)
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--out", default=str(Path(__file__).parent / "results/horovod_negotiation.json")
    )
    args = ap.parse_args()
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(free_port(), args, shared), nprocs=2)
        times = dict(shared)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    report = {
        "what": "Horovod-style DigitsCNN step, 2 ranks, gloo, with and without the mismatch check",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": vars(args),
        "median_step_ms": {arm: 1e3 * statistics.median(times[arm]) for arm in ARMS},
        "median_ratio_checked_over_unchecked": ratio("checked", "unchecked"),
        "median_ratio_checked_over_vote": ratio("checked", "vote"),
        "rounds_s_per_step": times,
        "versions": versions(),
        "machine": machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k.startswith("median")}))


if __name__ == "__main__":
    main()
