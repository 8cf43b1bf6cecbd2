"""One rank of a world started by :mod:`gpucheck.launch`: ``python -m gpucheck.rank DIR RANK``.

It reads ``DIR/spec.json``, joins the world's process group (NCCL, gloo, or none), says it is
ready, then runs each task from ``start`` on: its value goes to ``K.rankR.pt`` and its status to
``K.rankR.json`` (written last, so a status means the value is there). Rank 0 then waits for
every rank's status, runs the task's ``finish`` on their values and writes ``K.done.json``. A
rank whose task raised stops: the parent restarts the world ([Note: one failure, one restart]
in launch.py).
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from gpucheck.launch import POLL_S, RankContext, write_json


def _exit_when_orphaned(parent_pid: int) -> None:
    """End this rank once the parent is gone, even while the main thread is blocked in a
    collective (those release the GIL): a killed check must leave nothing running."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _function(name: str) -> Callable[..., Any]:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def _device(world: dict[str, Any], rank: int) -> str:
    import torch

    if world["device"] != "cuda":
        return "cpu"
    # longboat's own rule (world.device_for): the local rank's GPU, modulo the GPUs there are.
    return "cuda:0" if world["share_gpu"] else f"cuda:{rank % torch.cuda.device_count()}"


def _join(world: dict[str, Any], rank: int, port: int, device: str) -> None:
    """Join the world's process group the way a script that creates its own does
    (``longboat.initialize`` then finds it and keeps it)."""
    import torch
    import torch.distributed as dist
    from common import loopback_env  # benchmarks/ is on the ranks' path (launch.child_env)

    loopback_env(rank, world["size"], port)
    # NCCL says why it refuses something only at WARN and above; the parent keeps the log.
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    from longboat.comm.collectives import NCCL_RULES_VAR
    from longboat.world import before_group

    if world["backend"] == "gloo":
        # gloo takes tensors on any device; under the rules longboat's doorways refuse what
        # NCCL would ([Note: NCCL rules]), so a gloo world shows what NCCL ranks would meet.
        os.environ.setdefault(NCCL_RULES_VAR, "1")

    before_group()  # so that leaving the group ends gloo's threads ([Note: dynamo before...])
    if world["backend"] == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        world["backend"],
        init_method="env://",
        rank=rank,
        world_size=world["size"],
        timeout=timedelta(seconds=120),
    )


def _wait_for_ranks(directory: Path, k: int, size: int) -> list[dict[str, Any]]:
    """Every rank's status for task ``k`` (the parent kills this rank if one never comes)."""
    while True:
        statuses = []
        for r in range(size):
            try:
                statuses.append(json.loads((directory / f"{k}.rank{r}.json").read_text()))
            except (OSError, ValueError):
                break
        if len(statuses) == size:
            return statuses
        if any(s["status"] != "ok" for s in statuses):
            return statuses
        time.sleep(POLL_S)


def main(argv: list[str]) -> None:
    directory, rank = Path(argv[1]), int(argv[2])
    # A crash prints the Python stack, and the parent's SIGUSR1 every thread's, to the log.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads((directory / "spec.json").read_text())
    threading.Thread(target=_exit_when_orphaned, args=(spec["parent_pid"],), daemon=True).start()
    world = spec["world"]
    import torch

    torch.set_num_threads(world["threads"])
    device = _device(world, rank)
    if world["backend"] != "none":
        _join(world, rank, spec["port"], device)
    elif device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    ctx = RankContext(rank, world["size"], device, world["backend"], spec["dry"])
    (directory / f"ready.{rank}").touch()
    for k in range(spec["start"], len(spec["tasks"])):
        task = spec["tasks"][k]
        t0 = time.perf_counter()
        status: dict[str, Any] = {"status": "ok"}
        try:
            value = _function(task["run"])(task["args"], ctx)
            torch.save(value, directory / f"{k}.rank{rank}.pt")
        except BaseException:
            status = {"status": "error", "error": traceback.format_exc()}
        status["seconds"] = time.perf_counter() - t0
        write_json(directory / f"{k}.rank{rank}.json", status)
        if status["status"] != "ok":
            break
        if rank == 0:
            write_json(directory / f"{k}.done.json", _finish(directory, k, task, ctx))
    sys.stdout.flush()
    sys.stderr.flush()
    # Without interpreter teardown: nothing here needs it, and a process group's threads at
    # shutdown are a hazard of their own.
    os._exit(0)


def _finish(directory: Path, k: int, task: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    import torch

    statuses = _wait_for_ranks(directory, k, ctx.world_size)
    failed = [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if s["status"] != "ok"]
    if failed:
        return {"status": "error", "error": "\n".join(failed)}
    try:
        values = [
            torch.load(directory / f"{k}.rank{r}.pt", weights_only=True)
            for r in range(ctx.world_size)
        ]
        if task["finish"] is None:
            return {"status": "ok", "result": values[0]}
        return {"status": "ok", "result": _function(task["finish"])(task["args"], ctx, values)}
    except Exception:
        return {"status": "error", "error": "finish: " + traceback.format_exc()}


if __name__ == "__main__":
    main(sys.argv)
