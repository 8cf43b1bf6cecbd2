"""A GPT whose state is several times a rank's memory budget, trained with ZeRO-3 and everything
offloaded to disk: peak RSS per rank against the budget, and step time against what the disk
needs to move the step's bytes.

The model is built on the meta device and made unit by unit ([Note: deferred init]); its fp32
parameters and AdamW's two moments (12 bytes per parameter) are far larger than ``--budget-mib``.
ZeRO-3 shards them over ``--world-size`` ranks, and ``zero.offload_param`` and
``zero.offload_optimizer`` keep each rank's shards and optimizer state in files under ``--path``
([Note: parameter offload], [Note: optimizer state offload]). Per rank:

- peak RSS (``ru_maxrss``, the whole process from its start: imports, the process group, the
  model's construction, every step) against the budget, at glibc's defaults: no ``MALLOC_*``
  variable is set (``malloc_env`` records any the caller's environment had); the disk home fixes
  the mmap threshold itself ([Note: fixed mmap threshold] in ``longboat/heap.py``), so freed
  buffers go back to the system. The file pages the kernel caches are not the process's memory
  and are not in RSS;
- each step's wall time (forward, backward, step) and the bytes the rank read and wrote;
- the physical limit: those bytes over the disk's bandwidth, measured here on the same path
  with the same calls (``pwritev``/``preadv`` of whole files) in two ways: through the page
  cache, as the run does (with this machine's free memory the files stay cached), and with
  ``O_DIRECT`` (the device itself, no cache). Each rank does its own I/O on its own I/O thread;
  the limit assumes the two ranks' transfers overlap, so it is one rank's bytes over one
  stream's bandwidth.

The same model and steps run again with everything in memory (ZeRO-3 without offload: it fits
this machine, not the budget), for the step time offload costs: ``--repeats`` rounds of both
jobs, alternating (ABBA), each in fresh processes; the step ratio is the ratio of the per-round
medians' medians, beside the median of the per-round ratios.

Usage::

    python benchmarks/offload_headline.py          # about 7 minutes here

Writes ``benchmarks/results/offload_headline.json`` (``--out`` to change) with the config,
versions and machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

from longboat.config import load_config
from longboat.models import GPT, gpt_loss, gpt_param_count, synthetic_tokens
from longboat.plan import make_plan, resolve

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "offload_headline.json"
#: The caller's own malloc settings, if any (none are set here: the defaults a user gets).
MALLOC = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=21)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="steps not timed")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--budget-mib", type=float, default=1024.0, help="memory budget per rank")
    p.add_argument("--buffer-count", type=int, default=2, help="offload buffer_count")
    p.add_argument("--path", type=Path, default=Path("/var/tmp"), help="where the files go")
    p.add_argument("--disk-test-mib", type=int, default=512, help="file size of the disk test")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="rounds of the offloaded and the in-memory job, alternating (ABBA): the ratio is "
        "the median of the per-round ratios beside the ratio of the medians",
    )
    p.add_argument(
        "--no-compare-in-memory",
        dest="compare_in_memory",
        action="store_false",
        help="skip the run with everything in memory",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def _gpt_args(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": args.vocab,
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": args.heads,
        "seq_len": args.seq_len,
    }


def _config(args: argparse.Namespace, swap: str | None) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": 3, "unit_classes": ["_Block"]}
    if swap is not None:
        disk = {"device": "disk", "path": swap, "buffer_count": args.buffer_count}
        zero.update(offload_param=disk, offload_optimizer=disk)
    return {
        "strategy": "zero",
        "zero": zero,
        "batch": {"micro_batch_size": args.micro_batch},
        "log": {"progress": False, "level": "WARNING"},
    }


def _run(args: argparse.Namespace, swap: str | None) -> list[dict[str, Any]]:
    """One job of ``--world-size`` ranks; each rank's result."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        mp.spawn(_worker, args=(args, free_port(), swap, out_dir), nprocs=args.world_size)
        ranks = [
            json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world_size)
        ]
    err = next((r for r in ranks if r.get("error")), None)
    if err:
        sys.exit(f"rank {err['rank']} failed:\n{err['traceback']}")
    return ranks


def _peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``). Not ``ru_maxrss``: that one keeps, across
    the ``exec`` that starts a spawned rank, the resident set of the parent it was forked from."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _worker(rank: int, args: argparse.Namespace, port: int, swap: str | None, out_dir: str) -> None:
    join_loopback(rank, args.world_size, port, args.threads, args.timeout)
    import longboat

    result: dict[str, Any] = {"rank": rank}
    try:
        result["peak_rss_before_model_bytes"] = _peak_rss_bytes()
        with torch.device("meta"):
            model = GPT(**_gpt_args(args))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        engine = longboat.initialize(model, opt, _config(args, swap))
        result["setup_s"] = time.perf_counter() - t0
        result["peak_rss_after_setup_bytes"] = _peak_rss_bytes()
        gen = torch.Generator().manual_seed(rank)
        steps = []
        for i in range(args.warmup + args.steps):
            x, y = synthetic_tokens(args.micro_batch, args.seq_len, args.vocab, gen)
            nothing = {"read": 0, "written": 0}
            before = engine.strategy.offloaded or nothing
            t = time.perf_counter()
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
            wall = time.perf_counter() - t
            after = engine.strategy.offloaded or nothing
            if i >= args.warmup:
                steps.append(
                    {
                        "wall_s": wall,
                        "read_bytes": after["read"] - before["read"],
                        "written_bytes": after["written"] - before["written"],
                        "loss": engine.last_loss,
                    }
                )
        report = engine.memory_report()
        result.update(
            steps=steps,
            peak_rss_bytes=_peak_rss_bytes(),
            in_memory_between_steps=report.measured,
            on_disk=report.on_disk,
        )
        engine.close()
    except Exception as e:  # reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        if dist.is_initialized():
            dist.destroy_process_group()


def _bandwidth(directory: Path, size: int, direct: bool, repeats: int = 3) -> dict[str, float]:
    """Bytes per second of one whole-file ``pwritev`` and ``preadv`` of ``size`` bytes (median
    of ``repeats``), through the page cache or with ``O_DIRECT``."""
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (size >> 20))
    path = directory / f"disk-test.{os.getpid()}.bin"
    flags = os.O_DIRECT if direct else 0
    writes, reads = [], []
    try:
        for _ in range(repeats):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
            t = time.perf_counter()
            os.pwritev(fd, [buf], 0)
            if direct:
                os.fsync(fd)
            writes.append(time.perf_counter() - t)
            os.close(fd)
            fd = os.open(path, os.O_RDONLY | flags)
            t = time.perf_counter()
            got = os.preadv(fd, [buf], 0)
            reads.append(time.perf_counter() - t)
            os.close(fd)
            assert got == size
    finally:
        path.unlink(missing_ok=True)
        buf.close()
    return {
        "write_bytes_per_s": size / statistics.median(writes),
        "read_bytes_per_s": size / statistics.median(reads),
    }


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    t0 = time.time()
    a = gpt_param_count(args.vocab, args.d_model, args.layers, args.seq_len)
    state = 12 * a  # fp32 parameters + AdamW's two moments
    budget = int(args.budget_mib * 2**20)
    print(
        f"GPT {a:,} parameters: fp32 parameters + AdamW state {state / 2**30:.2f} GiB "
        f"({state / budget:.1f}x the {args.budget_mib:.0f} MiB budget per rank)",
        flush=True,
    )
    # What ZeRO-3 without offload would need per rank (planned on fake tensors, nothing run).
    plan = make_plan(
        resolve("gpt", _gpt_args(args)),
        load_config(_config(args, None)),
        args.world_size,
        args.micro_batch,
        "adamw",
        ["zero-3"],
    )
    planned = plan.strategies[0]
    print(f"ZeRO-3 without offload, planned peak per rank: {planned.peak / 2**20:,.0f} MiB")
    args.path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="offload-", dir=args.path) as swap:
        disk = {
            "page_cache": _bandwidth(Path(swap), args.disk_test_mib << 20, direct=False),
            "direct": _bandwidth(Path(swap), args.disk_test_mib << 20, direct=True),
        }
        for k, v in disk.items():
            print(
                f"disk ({k}): write {v['write_bytes_per_s'] / 2**30:.2f} GiB/s, "
                f"read {v['read_bytes_per_s'] / 2**30:.2f} GiB/s",
                flush=True,
            )
        # Alternating sides, ABBA: a machine that slows for a while slows both alike.
        rounds: list[dict[str, list[dict[str, Any]]]] = []
        for r in range(args.repeats):
            sides = ["offloaded", "in_memory"] if r % 2 == 0 else ["in_memory", "offloaded"]
            got = {}
            for side in sides:
                if side == "in_memory" and not args.compare_in_memory:
                    continue
                got[side] = _run(args, swap if side == "offloaded" else None)
            rounds.append(got)
        left = sorted(f.name for f in Path(swap).rglob("*.bin"))
    ranks, plain = rounds[0]["offloaded"], rounds[0].get("in_memory", [])

    def median_step(rank: dict[str, Any]) -> float:
        return statistics.median(s["wall_s"] for s in rank["steps"])

    summary = []
    for i, r in enumerate(ranks):
        per_round = [median_step(got["offloaded"][i]) for got in rounds]
        wall = statistics.median(per_round)
        peak = max(got["offloaded"][i]["peak_rss_bytes"] for got in rounds)
        read = statistics.median(s["read_bytes"] for s in r["steps"])
        written = statistics.median(s["written_bytes"] for s in r["steps"])
        # The time one stream needs to read and write the step's bytes, one after the other.
        limits = {
            k: read / v["read_bytes_per_s"] + written / v["write_bytes_per_s"]
            for k, v in disk.items()
        }
        row: dict[str, Any] = {
            "rank": r["rank"],
            "peak_rss_bytes": peak,
            "within_budget": peak <= budget,
            "median_step_s": wall,
            "per_round_median_step_s": per_round,
            "read_bytes_per_step": read,
            "written_bytes_per_step": written,
            "disk_limit_s": limits,
            "step_over_disk_limit": {k: wall / v for k, v in limits.items()},
        }
        line = (
            f"rank {r['rank']}: peak RSS {peak / 2**20:,.0f} MiB (budget "
            f"{args.budget_mib:.0f}: {'within' if row['within_budget'] else 'OVER'}), step "
            f"{wall:.2f} s, moved {(read + written) / 2**30:.2f} GiB/step, disk limit "
            f"{limits['page_cache']:.2f} s cached / {limits['direct']:.2f} s direct"
        )
        if plain:
            mem_rounds = [median_step(got["in_memory"][i]) for got in rounds]
            in_memory = statistics.median(mem_rounds)
            paired = [a / b for a, b in zip(per_round, mem_rounds, strict=True)]
            mem_peak = max(got["in_memory"][i]["peak_rss_bytes"] for got in rounds)
            row.update(
                in_memory_peak_rss_bytes=mem_peak,
                in_memory_median_step_s=in_memory,
                in_memory_per_round_median_step_s=mem_rounds,
                offloaded_over_in_memory=wall / in_memory,
                paired_ratios=paired,
                paired_ratio_median=statistics.median(paired),
            )
            line += (
                f"; in memory: step {in_memory:.2f} s (offloaded/in memory {wall / in_memory:.2f}"
                f", per round {', '.join(f'{x:.2f}' for x in paired)}), peak RSS "
                f"{mem_peak / 2**20:,.0f} MiB"
            )
        summary.append(row)
        print(line, flush=True)
    out = {
        "benchmark": "offload_headline",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": {
            "parameters": a,
            "fp32_params_and_adamw_state_bytes": state,
            "state_over_budget": state / budget,
        },
        "planned_zero3_without_offload": {
            "peak_bytes": planned.peak,
            "model_state_bytes": planned.model_state,
        },
        "malloc_env": MALLOC,
        "disk": disk,
        "summary": summary,
        "swap_files_left": left,
        "ranks": ranks,  # the first round's; every round's below
        "ranks_in_memory": plain,
        "rounds": rounds,
        "versions": versions(),
        "machine": machine(),
        "wall_time_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
