"""Measuring this machine for the cost model ([Note: cost model] in ``cost.py``), once, at the
start of a search: a matmul rate, the cost of dispatching an operator, an AdamW rate, the
bandwidth and latency of the gloo group at the job's world size and, with offload, the offload
directory's rate. Each rank of a bench run has one thread, so the per-process rates are taken
with one thread too. The whole takes a few seconds (most of it starting the ranks).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from longboat.tune.cost import Rates

LINK_BYTES = 4 * 2**20  # "a few MiB": large enough that bandwidth, not latency, dominates
LINK_ROUNDS = 5
LATENCY_ROUNDS = 20


def _timed(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds of ``fn`` over ``rounds`` calls, after one unmeasured call."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def op_seconds() -> float:
    """Seconds per operator of a forward and backward whose arithmetic is negligible (32 linear
    layers of width 4 and their activations, on 2 samples): what each operator of a
    micro-batch costs beside its arithmetic (dispatch, autograd's graph, module calls)."""
    from torch import nn

    from longboat.tune.cost import CountOps

    layers = [m for _ in range(32) for m in (nn.Linear(4, 4), nn.GELU())]
    model, x = nn.Sequential(*layers), torch.randn(2, 4)

    def run() -> None:
        model(x).sum().backward()

    counter = CountOps()
    with counter:
        run()
    return _timed(run, 10) / counter.ops


def adamw_elements_per_s(elements: int = 1 << 21) -> float:
    """Elements per second ``torch.optim.AdamW`` steps (fp32, its default implementation)."""
    p = torch.nn.Parameter(torch.zeros(elements))
    p.grad = torch.ones(elements)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return elements / _timed(opt.step, 5)


def disk_bytes_per_s(directory: str, nbytes: int = 64 * 2**20) -> float:
    """Bytes per second written and read back in ``directory`` with ``pwrite``/``pread``, as the
    offload does (through the page cache)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    data = os.urandom(1 << 20) * (nbytes >> 20)
    fd, path = tempfile.mkstemp(dir=directory, prefix="longboat-tune-")
    try:
        t0 = time.perf_counter()
        os.pwrite(fd, data, 0)
        got = os.pread(fd, nbytes, 0)
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    assert len(got) == nbytes
    return 2 * nbytes / elapsed


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (for the ranks' rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _link_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as the bench's ranks
    torch.set_num_threads(1)
    from longboat.world import bound_store

    timeout = timedelta(seconds=120)
    store = bound_store("127.0.0.1", port, rank, world_size, timeout)  # loopback only
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        big = torch.ones(LINK_BYTES // 4)
        small = torch.ones(1)
        t_big = _timed(lambda: dist.all_reduce(big), LINK_ROUNDS)
        t_small = _timed(lambda: dist.all_reduce(small), LATENCY_ROUNDS)
        times = torch.tensor([t_big, t_small], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        if rank == 0:
            Path(out_dir, "link.json").write_text(json.dumps(times.tolist()))
    finally:
        dist.destroy_process_group()


def link(world_size: int) -> tuple[float, float]:
    """Bytes a rank sends per second in a ring all-reduce of :data:`LINK_BYTES`, and the
    latency of an all-reduce of one float, on a gloo group of ``world_size`` fresh ranks."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import start_processes

    from longboat.bench.runner import PRELOAD

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, __name__])  # the same server bench launches from
    with tempfile.TemporaryDirectory(prefix="longboat-tune-") as tmp:
        start_processes(  # type: ignore[no-untyped-call]  # torch's is unannotated
            _link_worker,
            args=(world_size, free_port(), tmp),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
        t_big, t_small = json.loads(Path(tmp, "link.json").read_text())
    sent = 2 * (world_size - 1) / world_size * LINK_BYTES  # ring all-reduce, per rank
    return sent / t_big, t_small


def measure(world_size: int, offload_dir: str | None = None, bf16: bool = False) -> Rates:
    """Every rate the cost model needs, at ``world_size`` ranks (no link at one rank); with
    ``bf16``, the bf16 matmul rate too."""
    from longboat.observe.flops import matmul_rate

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each bench rank runs
    try:
        matmul = matmul_rate(torch.device("cpu"), seconds=0.3)
        low = matmul_rate(torch.device("cpu"), seconds=0.3, dtype=torch.bfloat16) if bf16 else None
        op = op_seconds()
        adamw = adamw_elements_per_s()
    finally:
        torch.set_num_threads(threads)
    bandwidth, latency = link(world_size) if world_size > 1 else (None, 0.0)
    disk = disk_bytes_per_s(offload_dir) if offload_dir else None
    return Rates(
        matmul_flops_per_s=matmul,
        op_s=op,
        adamw_elements_per_s=adamw,
        link_bytes_per_s=bandwidth,
        latency_s=latency,
        disk_bytes_per_s=disk,
        bf16_matmul_flops_per_s=low,
    )
