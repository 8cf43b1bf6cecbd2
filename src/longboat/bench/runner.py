"""Launch the ranks and measure; see [Note: bench phases].

[Note: bench phases] Step time and peak RSS need different layouts (as in
``benchmarks/zero_vs_peers.py``):

- Time: per world size ``n``, one launch of ``n`` ranks builds every side (one model copy each),
  runs ``warmup`` unmeasured steps of each, then ``steps`` rounds of one step per side, the
  order rotating every round and reversed every other round. Steps of different sides are
  seconds apart, so load from other processes lands on all sides alike.
- Memory: peak RSS (``ru_maxrss``) only grows within a process, so each side also runs alone in
  a fresh launch of ``n`` ranks for ``warmup + 2`` steps, and its peak RSS per rank is taken.
  With ``live_peak``, that launch also counts live tensor bytes from the model's construction
  on, with the planner's tracker (``longboat.plan.tracker.LiveBytes``): the quantity ``longboat
  plan`` predicts, which the allocator's retention does not blur as it does RSS.
- Deadline: with ``deadline`` (a ``time.time()``), no measured round starts after it (every
  side gets at least one), and no memory launch starts after it. The ranks agree on stopping
  by rank 0's verdict, broadcast between rounds, outside the timed steps.

Each rank times its own step with ``time.perf_counter`` (forward, loss, backward, optimizer step,
zero_grad; no barrier inside, which would hide a straggler); then the ranks all-reduce the MAX,
the step time a synchronous job sees. That all-reduce and the one averaging the loss are outside
the timed region. Data is drawn before the clock starts. Every rank draws the same global batch
from a generator seeded per side and takes its own slice (a pipeline's stages take all of it),
so all sides see the same samples.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessContext, start_processes

from longboat.bench.models import Batch, resolve_model, share_of
from longboat.bench.sides import (
    CONFIG_PREFIX,
    LONGBOAT_SIDES,
    Side,
    build_side,
    exists_at,
    import_deepspeed,
    library,
    micro_batch_of,
)
from longboat.world import before_group, bound_store

MEMORY_STEPS = 2
# What every rank imports anyway (torch.optim's first use imports torch._dynamo: ~1.5 s).
PRELOAD = [
    __name__,
    "longboat.engine",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
]


@dataclass(frozen=True)
class BenchSettings:
    """Everything a bench run depends on (recorded in full in the report)."""

    model: str = "reference-gpt"
    strategies: tuple[str, ...] = LONGBOAT_SIDES
    peers: tuple[str, ...] = ("ddp", "fsdp2", "deepspeed")
    world_sizes: tuple[int, ...] = (1, 2)
    micro_batch: int = 8
    seq_len: int = 128
    warmup: int = 2
    steps: int = 10
    scaling: Literal["weak", "strong"] = "weak"
    lr: float = 1e-4
    seed: int = 0
    threads: int = 1
    memory: bool = True
    pipeline_micro_batches: int = 4  # the pipeline side's micro-batches per step
    timeout_s: float = 300.0
    #: ``config:NAME`` sides and the longboat config (a mapping) each trains with
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    live_peak: bool = False  # the memory launches also count live tensor bytes
    deadline: float | None = None  # time.time() after which no round or memory launch starts

    def global_batch(self, n: int) -> int:
        """Samples per step at ``n`` ranks: weak scaling keeps the micro-batch per rank, strong
        scaling keeps the global batch (``micro_batch`` x the largest world size)."""
        if self.scaling == "weak":
            return self.micro_batch * n
        return self.micro_batch * max(self.world_sizes)


@dataclass
class Launch:
    """What one launch of ranks measured."""

    world_size: int
    phase: str
    sides: list[str]
    ranks: list[dict[str, Any]] = field(default_factory=list)


ProgressFn = Callable[[str, int, int], None]  # (side, done, total)
BenchProgressFn = Callable[[int, str, str, int, int], None]  # (world size, phase, side, ...)


def sides_at(names: list[str], n: int) -> list[str]:
    """The sides that exist at world size ``n`` (:func:`~longboat.bench.sides.exists_at`)."""
    return [s for s in names if exists_at(s, n)]


# -- inside a rank -----------------------------------------------------------------------------


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _timed_step(
    step: Callable[[Batch], torch.Tensor | None], batch: Batch, n: int
) -> tuple[float, float, float]:
    """One step: the MAX over ranks of its wall and CPU time, and its loss averaged over the
    ranks that trained (a parameter server's server did not)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss = step(batch)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    t = torch.tensor([elapsed, cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mean = torch.zeros(2, dtype=torch.float64)
    if loss is not None:
        mean[0], mean[1] = loss.detach().to(torch.float64), 1.0
    dist.all_reduce(mean)
    return t[0].item(), t[1].item(), (mean[0] / mean[1]).item()


def _measure(
    rank: int,
    s: BenchSettings,
    n: int,
    phase: str,
    names: list[str],
    result: dict[str, Any],
    report: Callable[[str, int, int], None],
) -> None:
    spec = resolve_model(s.model, s.seq_len)
    unavailable: dict[str, str] = {}
    if any(library(x) == "deepspeed" for x in names):
        why = import_deepspeed()
        if why:
            unavailable.update({x: why for x in names if library(x) == "deepspeed"})
    gb = s.global_batch(n)
    sides: dict[str, Side] = {}
    result["rss_after_import_bytes"] = _peak_rss_bytes()
    with contextlib.ExitStack() as stack:
        tracker = None
        if phase == "memory" and s.live_peak:
            from longboat.plan.tracker import LiveBytes

            # From before the model is built, as the planner counts ([Note: peak model]).
            tracker = stack.enter_context(LiveBytes())
        _steps(rank, s, n, phase, names, result, report, spec, unavailable, gb, sides)
    if tracker is not None:
        result["live_peak_bytes"] = tracker.max_peak
    for side in sides.values():
        side.close()


def _stop_now(s: BenchSettings) -> bool:
    """Whether the deadline has passed, as rank 0 sees it (every rank gets the same answer)."""
    flag = torch.tensor([float(s.deadline is not None and time.time() > s.deadline)])
    dist.broadcast(flag, src=0)  # rank 0's clock decides: the ranks' clocks may straddle it
    return bool(flag.item())


def _steps(
    rank: int,
    s: BenchSettings,
    n: int,
    phase: str,
    names: list[str],
    result: dict[str, Any],
    report: Callable[[str, int, int], None],
    spec: Any,
    unavailable: dict[str, str],
    gb: int,
    sides: dict[str, Side],
) -> None:
    """Build the sides into ``sides``, run the warm-up and the measured rounds."""
    for name in names:
        if name in unavailable:
            continue
        try:
            sides[name] = build_side(
                name, spec, s.seed, s.lr, gb // n, n, s.pipeline_micro_batches, s.configs
            )
        except Exception as e:
            if library(name) != "deepspeed":
                raise
            unavailable[name] = f"deepspeed.initialize failed: {type(e).__name__}: {e}"
    torch.set_num_threads(s.threads)
    gens = {x: torch.Generator().manual_seed(s.seed) for x in sides}
    built = tuple(sides)
    times: dict[str, list[float]] = {x: [] for x in built}
    cpu: dict[str, list[float]] = {x: [] for x in built}
    losses: dict[str, list[float]] = {x: [] for x in built}
    measured = s.steps if phase == "timing" else MEMORY_STEPS
    total = len(built) * (s.warmup + measured)
    done = 0

    def run(name: str, k: int, keep: bool) -> None:
        nonlocal done
        for _ in range(k):
            batch = spec.batch(gb, gens[name])
            if not sides[name].shares_batch:
                batch = share_of(batch, rank, n)
            dt, c, loss = _timed_step(sides[name].step, batch, n)
            losses[name].append(loss)
            if keep:
                times[name].append(dt)
                cpu[name].append(c)
            done += 1
            report(name, done, total)

    for name in built:
        run(name, s.warmup, keep=False)
    order = []
    for r in range(measured):
        if r and phase == "timing" and s.deadline is not None and _stop_now(s):
            break  # every side has had the same number of rounds
        # Rotate, and reverse every other round, so no side always follows the same one.
        rot = built[r % max(len(built), 1) :] + built[: r % max(len(built), 1)]
        order.append(list(rot if r % 2 == 0 else tuple(reversed(rot))))
        for name in order[-1]:
            run(name, 1, keep=True)
    result.update(
        step_times_s=times,
        cpu_times_s=cpu,
        losses=losses,
        unavailable=unavailable,
        round_order=order,
        peak_rss_bytes=_peak_rss_bytes(),
        state_bytes={x: sides[x].state_bytes() for x in built},
    )


def _worker(
    rank: int,
    s: BenchSettings,
    n: int,
    port: int,
    phase: str,
    names: list[str],
    out_dir: str,
    progress: Any,
) -> None:
    # longboat.initialize finds the job through these variables and reuses the group we open.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(n),
        LOCAL_WORLD_SIZE=str(n),
        LOCAL_SIZE=str(n),
    )  # DeepSpeed's CPU accelerator counts "devices" by it
    if sys.platform.startswith("linux"):
        # Pin gloo to loopback: the hostname may name an interface the other ranks cannot reach.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # DeepSpeed still calls the collectives by their pre-2.13 names: one warning per call site.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    torch.set_num_threads(s.threads)
    before_group()
    timeout = timedelta(seconds=s.timeout_s)
    store = bound_store("127.0.0.1", port, rank, n, timeout)  # not torch's wildcard listener
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)
    result: dict[str, Any] = {"rank": rank}

    def report(name: str, done: int, total: int) -> None:
        if rank == 0:
            progress.put((name, done, total))

    try:
        _measure(rank, s, n, phase, names, result, report)
    except Exception as e:  # reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        tmp = Path(out_dir, f"rank{rank}.json.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(tmp.with_suffix(""))  # whole or absent, whatever happens next
        if "error" not in result:
            dist.barrier()  # all reported: tear down together
        dist.destroy_process_group()


# -- the parent --------------------------------------------------------------------------------


class BenchError(RuntimeError):
    """A launch failed; the message names the world size, sides and rank."""


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def launch(
    s: BenchSettings, n: int, phase: str, names: list[str], on_progress: ProgressFn
) -> Launch:
    """One launch of ``n`` fresh ranks running ``names``; forwards rank 0's progress."""
    # Ranks fork from a server that imported torch and this module once: a launch then costs a
    # fork, not an interpreter start and a torch import per rank (seconds each), and the server
    # never ran an operator, so no thread pool is forked mid-use.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="longboat-bench-") as tmp:
        crash = None
        try:
            pc: ProcessContext = start_processes(  # type: ignore[no-untyped-call]  # torch's is unannotated
                _worker,
                args=(s, n, _free_port(), phase, names, tmp, q),
                nprocs=n,
                join=False,
                start_method="forkserver",
            )
            while not pc.join(timeout=0.2):
                _drain(q, on_progress)
        except Exception as e:  # judged below by what the ranks reported
            crash = f"{type(e).__name__}: {str(e).strip()[-2000:]}"
        _drain(q, on_progress)
        files = [Path(tmp, f"rank{r}.json") for r in range(n)]
        if not all(f.exists() for f in files):
            raise BenchError(
                f"world size {n}, {phase} launch of {names}: a rank died before "
                f"it reported: {crash}"
            )
        ranks = [json.loads(f.read_text()) for f in files]
    err = next((x for x in ranks if x.get("error")), None)
    if err is not None:
        raise BenchError(
            f"world size {n}, {phase} launch of {names} failed on rank "
            f"{err['rank']}:\n{err['traceback']}"
        )
    return Launch(world_size=n, phase=phase, sides=names, ranks=ranks)


def _drain(q: Any, on_progress: ProgressFn) -> None:
    while True:
        try:
            name, done, total = q.get_nowait()
        except (queue.Empty, OSError, EOFError):
            return
        on_progress(name, done, total)


def _row(
    s: BenchSettings, n: int, side: str, timing: Launch, memory: Launch | None
) -> dict[str, Any]:
    r0 = timing.ranks[0]
    t = r0["step_times_s"][side]
    # Spread: the interquartile range (0 for a single measured step).
    q1, _, q3 = statistics.quantiles(t, n=4, method="inclusive") if len(t) > 1 else (0, 0, 0)
    med = statistics.median(t)
    gb = s.global_batch(n)
    mem_ranks = memory.ranks if memory is not None else None
    return {
        "side": side,
        "library": library(side),
        "world_size": n,
        "global_batch": gb,
        "micro_batch": (
            s.configs[side]["batch"]["micro_batch_size"]
            if side in s.configs
            else micro_batch_of(side, gb, n, s.pipeline_micro_batches)
        ),
        "measured_steps": len(t),
        "step_time_median_s": med,
        "step_time_min_s": min(t),
        "step_time_max_s": max(t),
        "step_time_iqr_s": q3 - q1,
        "cpu_time_median_s": statistics.median(r0["cpu_times_s"][side]),
        "samples_per_s": gb / med,
        "speedup": None,
        "efficiency": None,
        "peak_rss_bytes_per_rank": [x["peak_rss_bytes"] for x in mem_ranks] if mem_ranks else None,
        # RSS before the side was built: what the peak includes besides the side itself
        "rss_after_import_bytes_per_rank": (
            [x["rss_after_import_bytes"] for x in mem_ranks] if mem_ranks else None
        ),
        "live_peak_bytes_per_rank": (
            [x["live_peak_bytes"] for x in mem_ranks] if mem_ranks and s.live_peak else None
        ),
        "state_bytes_per_rank": [x["state_bytes"][side] for x in timing.ranks],
        "losses": r0["losses"][side],
        "step_times_s": t,
    }


def run_bench(s: BenchSettings, on_progress: BenchProgressFn | None = None) -> dict[str, Any]:
    """Measure every side at every world size; returns the results (see :mod:`.report`).

    ``on_progress(world_size, phase, side, done, total)`` is called as rank 0 finishes steps.
    """
    from longboat.bench.sides import peer_sides

    say = on_progress or (lambda *_: None)
    unavailable: dict[str, str] = {}
    peers = list(s.peers)
    if "deepspeed" in peers:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            unavailable["deepspeed"] = "not installed (pip install deepspeed to compare)"
            peers.remove("deepspeed")
    names = [x for x in LONGBOAT_SIDES if x in s.strategies] + peer_sides(
        tuple(peers), s.strategies
    )
    names += [x for x in s.configs if x.startswith(CONFIG_PREFIX)]
    rows: list[dict[str, Any]] = []
    orders: dict[str, Any] = {}
    t_start = time.perf_counter()
    for n in s.world_sizes:
        here = sides_at(names, n)

        def fwd(phase: str, n: int = n) -> ProgressFn:
            return lambda name, done, total: say(n, phase, name, done, total)

        timing = launch(s, n, "timing", here, fwd("timing"))
        for side, why in timing.ranks[0]["unavailable"].items():
            unavailable.setdefault(side, why)
        orders[str(n)] = timing.ranks[0]["round_order"]
        for side in here:
            if side in unavailable:
                continue
            late = s.deadline is not None and time.time() > s.deadline
            memory = (
                launch(s, n, "memory", [side], fwd(f"memory {side}"))
                if s.memory and not late
                else None
            )
            rows.append(_row(s, n, side, timing, memory))
    base = {r["side"]: r["samples_per_s"] for r in rows if r["world_size"] == 1}
    for r in rows:
        if r["side"] in base:
            r["speedup"] = r["samples_per_s"] / base[r["side"]]
            r["efficiency"] = r["speedup"] / r["world_size"]
    return {
        "settings": {**asdict(s), "memory_steps_after_warmup": MEMORY_STEPS},
        "model": resolve_model(s.model, s.seq_len).info,
        "rows": rows,
        "unavailable": unavailable,
        "round_order": orders,
        "wall_time_s": time.perf_counter() - t_start,
    }
