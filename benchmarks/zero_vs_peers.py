"""Step time and peak memory of longboat's ZeRO-2 and ZeRO-3 against torch FSDP2 and DeepSpeed.

Six sides train the reference GPT (:func:`longboat.models.reference_gpt`) with AdamW, built from
the same seed and fed the same batches, on the same number of gloo ranks:

=================  ==============================================================================
side               what it runs
=================  ==============================================================================
longboat_zero2     ``longboat.initialize(config={"strategy": "zero", "zero": {"stage": 2}})``
fsdp2_zero2        ``fully_shard`` on each ``model.blocks[i]`` and the root,
                   ``reshard_after_forward=False`` (gradients and optimizer state sharded, full
                   parameters kept between forward and backward: FSDP2's ZeRO-2)
deepspeed_zero2    ``deepspeed.initialize`` with ``zero_optimization.stage = 2``
longboat_zero3     ``{"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["_Block"]}}``
fsdp2_zero3        as fsdp2_zero2 with ``reshard_after_forward=True``
deepspeed_zero3    ``deepspeed.initialize`` with ``zero_optimization.stage = 3``
=================  ==============================================================================

Every side uses its library's defaults beyond that (longboat's 25 MB ZeRO-2 buckets and stage-3
prefetch; DeepSpeed's bucket sizes and ``overlap_comm``); the DeepSpeed config is in the JSON.
One exception: DeepSpeed clips gradients to a global norm of 1.0 unless told otherwise, so its
config sets ``gradient_clipping = 0`` (longboat and FSDP2 do not clip by default).

[Note: two phases] Step time and peak RSS need different layouts.

- Time: one pair of ranks builds all six sides (six copies of the model) and measures their
  steps alternately, as ``replicate_vs_ddp.py`` does: after ``--warmup`` steps of each side,
  round r runs ``--steps-per-round`` steps of every side, the order rotating every round and
  reversed every other round (ABBA). Steps of different sides are then seconds apart, so load
  from other jobs on a shared machine, which comes and goes over tens of seconds, lands on all
  sides alike; the median of per-round ratios cancels it further. (A first version spawned a
  fresh pair per side and round; with rounds minutes apart, a neighbour's load swung its
  medians by 2x.) Sharing one process is safe here: the sides share no module, and their
  losses match step for step those of the sides run alone (checked below).
- Memory: peak RSS (``ru_maxrss``) only ever grows within a process, so it cannot be split
  among sides that share one. Each side therefore also runs alone in a fresh pair of ranks
  (``--memory-repeats`` times, the side order reversed every other time), for ``--warmup`` +
  ``--memory-steps`` steps, and reports per rank its peak RSS and the increase of that peak over
  the RSS right after the model was built (imports, e.g. DeepSpeed's, count in the peak but not
  in the increase), and for longboat ``engine.memory_report()``. Those pairs' step times are
  kept too (``isolated_samples_s``), as a cross-check.

One step is forward, loss, backward, optimizer step, zero_grad. Each rank times its own step
with ``time.perf_counter`` (no barrier inside the step: a barrier would hide the straggler), then
the ranks all-reduce the MAX of that time, which is the step time a synchronous job sees. The
all-reduce (and the one that averages the loss over ranks) is outside the timed region. Beside
the median, the minimum and the median CPU time per step (``time.process_time``, all threads of
the rank including gloo's, max over ranks) are reported: other jobs' load inflates wall time a
lot and CPU time only a little, so when medians and CPU ratios disagree, the machine was busy.

Budget: with the defaults (timing: 2 warm-up + 10 measured steps of each side, about 2 minutes;
memory: 12 pairs of 4 steps, about 3) a run takes about 5 minutes on 2 quiet cores; the first
DeepSpeed run also JIT-builds DeepSpeed's shared-memory comm op (unused for training), about a
minute, cached after.

Sameness: every side does the same arithmetic up to float rounding (AdamW is element-wise, so a
sharded optimizer is exact), so the per-step losses (averaged over ranks) and a final
evaluation loss on a fixed batch after training are compared across sides and between the two
phases (``max_abs_loss_diff``); the evaluation loss of the untrained model (``eval_loss_init``,
one process) shows that training moved it.

DeepSpeed is optional and a benchmark-only dependency (after torch:
``DS_BUILD_OPS=0 pip install deepspeed``). It runs on its CPU accelerator (``DS_ACCELERATOR=cpu``),
which falls back to gloo when oneCCL's bindings are absent; the ranks open the gloo group first
and ``deepspeed.init_distributed(dist_backend="gloo")`` adopts it. If it cannot be imported or
fails to initialise, the reason is printed and recorded in the JSON and the other sides still run.

Usage::

    python benchmarks/zero_vs_peers.py                    # all sides, writes results JSON
    python benchmarks/zero_vs_peers.py --stage 3          # the ZeRO-3 sides only
    python benchmarks/zero_vs_peers.py --only fsdp2_zero2 # one side alone

Writes ``benchmarks/results/zero_vs_peers.json`` (``--out`` to change) and prints a table and the
ratio lines ``ratio time (longboat_zero2 / fsdp2_zero2) = X.XXX`` and so on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port, join_loopback, machine, versions

from longboat.bench.models import reference_gpt_spec
from longboat.bench.sides import DeepSpeedSide, deepspeed_config, import_deepspeed, make_fsdp2
from longboat.models import GPT, gpt_loss, reference_gpt, synthetic_tokens

SIDES = (
    "longboat_zero2",
    "fsdp2_zero2",
    "deepspeed_zero2",
    "longboat_zero3",
    "fsdp2_zero3",
    "deepspeed_zero3",
)
STAGE_OF = {name: int(name[-1]) for name in SIDES}
PEERS = ("fsdp2", "deepspeed")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zero_vs_peers.json"

# A step takes a batch and returns the (detached) loss.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The model a side trains, as a callable for the evaluation forward after training.
ForwardFn = Callable[[torch.Tensor], torch.Tensor]


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="number of ranks (processes)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side, first")
    p.add_argument("--rounds", type=int, default=10, help="timing rounds (each runs every side)")
    p.add_argument("--steps-per-round", type=int, default=1, help="steps per side per round")
    p.add_argument(
        "--memory-repeats",
        type=int,
        default=2,
        help="fresh process pairs per side for peak RSS (0: skip the memory phase)",
    )
    p.add_argument(
        "--memory-steps", type=int, default=2, help="steps after the warm-up in each memory pair"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stage", type=int, choices=(2, 3), default=None, help="measure one stage's sides only"
    )
    p.add_argument("--only", choices=SIDES, default=None, help="measure one side alone")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds a collective may wait before a pair is declared hung",
    )
    p.add_argument("--out", type=Path, default=None, help=f"results JSON (default {DEFAULT_OUT})")
    args = p.parse_args(argv)
    if args.warmup < 2:
        p.error("--warmup must be at least 2 (the first steps allocate buffers and state)")
    if args.rounds * args.steps_per_round < 5:
        p.error("--rounds x --steps-per-round must give at least 5 measured steps per side")
    if args.memory_steps < 1:
        p.error("--memory-steps must be at least 1")
    return args


def _rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc; elsewhere: the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _ds_config(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    # The same config `longboat bench` gives DeepSpeed, so the two report comparable numbers.
    return deepspeed_config(stage, args.micro_batch, args.world_size)


# -- the sides ---------------------------------------------------------------------------------


def _make_longboat(
    model: GPT, args: argparse.Namespace, stage: int
) -> tuple[StepFn, ForwardFn, Callable[[], Any]]:
    import longboat

    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["unit_classes"] = ["_Block"]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine = longboat.initialize(
        model,
        opt,
        config={
            "strategy": "zero",
            "zero": zero,
            "batch": {"micro_batch_size": args.micro_batch},
            "log": {"progress": False},
        },
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = gpt_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step, engine, engine.memory_report


# FSDP2 and DeepSpeed are built by longboat.bench.sides, so this script and `longboat bench`
# measure the same peers.


def _make_fsdp2(model: GPT, args: argparse.Namespace, stage: int) -> tuple[StepFn, ForwardFn, None]:
    side = make_fsdp2(f"fsdp2_zero{stage}", reference_gpt_spec(args.seq_len), model, args.lr)
    return lambda x, y: side.step((x, y)), model, None


def _make_deepspeed(
    model: GPT, args: argparse.Namespace, stage: int
) -> tuple[StepFn, ForwardFn, None]:
    side = DeepSpeedSide(
        f"deepspeed_zero{stage}",
        reference_gpt_spec(args.seq_len),
        model,
        args.lr,
        args.micro_batch,
        args.world_size,
    )
    return lambda x, y: side.step((x, y)), side.engine, None


MAKERS = {"longboat": _make_longboat, "fsdp2": _make_fsdp2, "deepspeed": _make_deepspeed}


# -- one process pair --------------------------------------------------------------------------


def _timed_step(
    step: StepFn, batch: tuple[torch.Tensor, torch.Tensor], world: int
) -> tuple[float, float, float]:
    """Run one step; return the max over ranks of its wall time and of its CPU time (all of
    the process's threads, gloo's included), and its loss averaged over ranks."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    loss = step(*batch)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - c0
    t = torch.tensor([elapsed, cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mean = loss.detach().to(torch.float64).reshape(1)
    dist.all_reduce(mean)
    return t[0].item(), t[1].item(), mean.item() / world


def _eval_batch(args: argparse.Namespace, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_tokens(
        args.micro_batch, args.seq_len, vocab, torch.Generator().manual_seed(args.seed + 4242)
    )


def _eval_loss(forward: ForwardFn, args: argparse.Namespace, vocab: int) -> float:
    """The loss of the trained weights on one fixed batch (the same on every rank)."""
    x, y = _eval_batch(args, vocab)
    with torch.no_grad():
        ev = gpt_loss(forward(x), y).to(torch.float64).reshape(1)
    dist.all_reduce(ev)
    return ev.item() / dist.get_world_size()


def _eval_loss_init(args: argparse.Namespace) -> float:
    """The evaluation loss of the untrained model, in this (unmeasured) process."""
    torch.manual_seed(args.seed)
    model = reference_gpt()
    x, y = _eval_batch(args, model.vocab_size)
    with torch.no_grad():
        return gpt_loss(model(x), y).item()


def _import_deepspeed() -> str | None:
    """Import DeepSpeed on its CPU accelerator over our gloo group; the reason if it cannot."""
    return import_deepspeed()


def _lib(side: str) -> str:
    return side.rsplit("_zero", 1)[0]


def _build(
    args: argparse.Namespace, side: str, result: dict[str, Any]
) -> tuple[StepFn, ForwardFn, Callable[[], Any] | None, int] | str:
    """Build and wrap ``side``'s model; the reason instead when DeepSpeed fails to initialise.

    Same seed on every side: identical weights, identical batches (the generator differs per
    rank only), so all sides do the same arithmetic and their losses can be compared.
    """
    torch.manual_seed(args.seed)
    model = reference_gpt()
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["model"] = {
        "vocab_size": model.vocab_size,
        "d_model": model.d_model,
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "seq_len": model.seq_len,
    }
    result.setdefault("rss_baseline_bytes", _rss_bytes())
    try:
        step, forward, report = MAKERS[_lib(side)](model, args, STAGE_OF[side])
    except Exception as e:
        if _lib(side) != "deepspeed":
            raise
        return f"deepspeed.initialize failed: {type(e).__name__}: {e}"
    return step, forward, report, model.vocab_size


def _run_timing(
    rank: int, args: argparse.Namespace, sides: tuple[str, ...], result: dict[str, Any]
) -> None:
    """All sides in this pair, their steps alternated; see [Note: two phases]."""
    unavailable: dict[str, str] = {}
    if any(_lib(s) == "deepspeed" for s in sides):
        why = _import_deepspeed()
        if why:
            unavailable.update({s: why for s in sides if _lib(s) == "deepspeed"})
    steps: dict[str, StepFn] = {}
    forwards: dict[str, ForwardFn] = {}
    gens: dict[str, torch.Generator] = {}
    vocab = 0
    for side in sides:
        if side in unavailable:
            continue
        built = _build(args, side, result)
        if isinstance(built, str):
            unavailable[side] = built
            continue
        steps[side], forwards[side], _, vocab = built
        gens[side] = torch.Generator().manual_seed(args.seed * 1000 + rank)
    torch.set_num_threads(args.threads)
    names = tuple(steps)
    samples: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}

    def run_side(name: str, n: int, measure: bool) -> None:
        for _ in range(n):
            # Data is drawn before the clock starts: we time training, not the RNG.
            batch = synthetic_tokens(args.micro_batch, args.seq_len, vocab, gens[name])
            dt, c, loss = _timed_step(steps[name], batch, args.world_size)
            losses[name].append(loss)
            if measure:
                samples[name].append(dt)
                cpu[name].append(c)

    for name in names:
        run_side(name, args.warmup, measure=False)
    order = []
    for r in range(args.rounds):
        # Rotate, and reverse every other round, so no side always follows the same one.
        rot = names[r % len(names) :] + names[: r % len(names)]
        order.append(list(rot if r % 2 == 0 else tuple(reversed(rot))))
        for name in order[-1]:
            run_side(name, args.steps_per_round, measure=True)
    result.update(
        samples_s=samples,
        cpu_samples_s=cpu,
        losses=losses,
        unavailable=unavailable,
        round_order=order,
        threads=torch.get_num_threads(),
        eval_loss={n: _eval_loss(forwards[n], args, vocab) for n in names},
    )
    for n in names:
        if _lib(n) == "longboat":
            forwards[n].close()  # type: ignore[attr-defined]


def _run_memory(rank: int, args: argparse.Namespace, side: str, result: dict[str, Any]) -> None:
    """One side alone in this pair, for its peak RSS; see [Note: two phases]."""
    if _lib(side) == "deepspeed":
        why = _import_deepspeed()
        if why:
            result["unavailable"] = why
            return
    built = _build(args, side, result)
    if isinstance(built, str):
        result["unavailable"] = built
        return
    step, forward, memory_report, vocab = built
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    samples: list[float] = []
    losses: list[float] = []
    for i in range(args.warmup + args.memory_steps):
        batch = synthetic_tokens(args.micro_batch, args.seq_len, vocab, gen)
        dt, _, loss = _timed_step(step, batch, args.world_size)
        losses.append(loss)
        if i >= args.warmup:
            samples.append(dt)
    peak = _peak_rss_bytes()  # before anything else runs: the evaluation must not count
    result.update(
        samples_s=samples,
        losses=losses,
        peak_rss_bytes=peak,
        rss_increase_bytes=peak - result["rss_baseline_bytes"],
        rss_end_bytes=_rss_bytes(),
    )
    if memory_report is not None:
        rep = memory_report()
        result["memory_report"] = {
            **dataclasses.asdict(rep),
            "total": rep.total,
            "expected_total": rep.expected_total,
        }
    result["eval_loss"] = _eval_loss(forward, args, vocab)
    if _lib(side) == "longboat":
        forward.close()  # type: ignore[attr-defined]


def _worker(
    rank: int, args: argparse.Namespace, port: int, phase: str, sides: tuple[str, ...], out_dir: str
) -> None:
    # DeepSpeed still calls the tensor collectives by their pre-2.13 names; one warning per
    # call site and rank would bury the table.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning
    )
    # DeepSpeed's CPU accelerator counts "devices" by LOCAL_SIZE.
    join_loopback(
        rank, args.world_size, port, args.threads, args.timeout, LOCAL_SIZE=str(args.world_size)
    )
    result: dict[str, Any] = {"phase": phase, "sides": list(sides), "rank": rank}
    try:
        if phase == "timing":
            _run_timing(rank, args, sides, result)
        else:
            _run_memory(rank, args, sides[0], result)
    except Exception as e:  # reported to the parent
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        tmp = Path(out_dir, f"rank{rank}.json.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(tmp.with_suffix(""))  # whole or absent, whatever happens next
        if "error" not in result:
            dist.monitored_barrier(timeout=timedelta(seconds=60))  # all reported: tear down
        dist.destroy_process_group()


def _spawn_pair(
    args: argparse.Namespace, phase: str, sides: tuple[str, ...]
) -> list[dict[str, Any]]:
    """One fresh process pair; returns each rank's result (or raises).

    A rank that dies after every rank reported (seen once in ~20 pairs: ``terminate called
    without an active exception``, SIGABRT, while the ranks tear down) does not void the
    measurement; the crash is kept with the results as ``teardown_crash``.
    """
    with tempfile.TemporaryDirectory(prefix="zero_vs_peers-") as tmp:
        crash = None
        try:
            mp.spawn(
                _worker,
                args=(args, free_port(), phase, sides, tmp),
                nprocs=args.world_size,
                join=True,
            )
        except Exception as e:  # judged below by what the ranks reported
            crash = f"{type(e).__name__}: {str(e).strip()[-2000:]}"
        files = [Path(tmp, f"rank{r}.json") for r in range(args.world_size)]
        if not all(f.exists() for f in files):
            raise RuntimeError(
                f"a rank of the {phase} pair {list(sides)} died before it reported: {crash}"
            )
        ranks = [json.loads(f.read_text()) for f in files]
        if crash is not None:
            for x in ranks:
                x["teardown_crash"] = crash
        return ranks


def _spawn_with_retry(
    args: argparse.Namespace,
    phase: str,
    sides: tuple[str, ...],
    incidents: list[str],
    may_fail: bool,
) -> list[dict[str, Any]] | None:
    """:func:`_spawn_pair`, once more if a rank died before reporting; None if it died twice
    and ``may_fail`` (a DeepSpeed side alone)."""
    for attempt in (1, 2):
        try:
            ranks = _spawn_pair(args, phase, sides)
        except RuntimeError as e:
            incidents.append(f"{phase} {list(sides)} attempt {attempt}: {e}")
            print(f"incident: {incidents[-1]}", flush=True)
            if attempt == 2:
                if may_fail:
                    return None
                raise
            continue
        if "teardown_crash" in ranks[0]:
            incidents.append(
                f"{phase} {list(sides)}: a rank crashed after reporting: "
                f"{ranks[0]['teardown_crash']}"
            )
        err = next((x for x in ranks if x.get("error")), None)
        if err is not None:
            sys.exit(
                f"{phase} pair {list(sides)} failed on rank {err['rank']}:\n{err['traceback']}"
            )
        return ranks
    return None


# -- the report --------------------------------------------------------------------------------


def _pairs(sides: tuple[str, ...]) -> list[tuple[str, str]]:
    """(longboat side, peer side) for each stage, for the peers that ran."""
    out = []
    for lb in sides:
        if lb.startswith("longboat_"):
            for peer in PEERS:
                other = f"{peer}_zero{STAGE_OF[lb]}"
                if other in sides:
                    out.append((lb, other))
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def _max_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0)


def _report(
    args: argparse.Namespace,
    timing: list[dict[str, Any]],
    memory: dict[str, list[list[dict[str, Any]]]],
    unavailable: dict[str, str],
    memory_order: list[list[str]],
    wall: float,
    incidents: list[str],
) -> None:
    t0 = timing[0]
    samples: dict[str, list[float]] = t0["samples_s"]
    cpu_samples: dict[str, list[float]] = t0["cpu_samples_s"]
    ran = tuple(samples)
    medians = {s: statistics.median(v) for s, v in samples.items()}
    cpu_medians = {s: statistics.median(v) for s, v in cpu_samples.items()}
    pairs = _pairs(ran)
    k = args.steps_per_round

    def per_round(s: str) -> list[float]:
        return [statistics.median(samples[s][i : i + k]) for i in range(0, len(samples[s]), k)]

    ratios = {f"{a}/{b}": medians[a] / medians[b] for a, b in pairs}
    # Round r's samples of every side ran within seconds of each other, so the per-round ratio
    # cancels load that other processes put on the machine for a while.
    paired = {
        f"{a}/{b}": statistics.median(
            x / y for x, y in zip(per_round(a), per_round(b), strict=True)
        )
        for a, b in pairs
    }
    min_ratios = {f"{a}/{b}": min(samples[a]) / min(samples[b]) for a, b in pairs}
    cpu_ratios = {f"{a}/{b}": cpu_medians[a] / cpu_medians[b] for a, b in pairs}

    # Memory: per rank, the median over the pairs; the headline is the rank that needed most.
    mem = {s: runs for s, runs in memory.items() if runs}
    peak_rank = {
        s: [
            statistics.median(rr[r]["peak_rss_bytes"] for rr in runs)
            for r in range(args.world_size)
        ]
        for s, runs in mem.items()
    }
    incr_rank = {
        s: [
            statistics.median(rr[r]["rss_increase_bytes"] for rr in runs)
            for r in range(args.world_size)
        ]
        for s, runs in mem.items()
    }
    peak = {s: max(v) for s, v in peak_rank.items()}
    incr = {s: max(v) for s, v in incr_rank.items()}
    mpairs = _pairs(tuple(mem))
    rss_ratios = {f"{a}/{b}": peak[a] / peak[b] for a, b in mpairs}
    incr_ratios = {f"{a}/{b}": incr[a] / incr[b] for a, b in mpairs}
    isolated = {s: [t for rr in runs for t in rr[0]["samples_s"]] for s, runs in mem.items()}
    isolated_medians = {s: statistics.median(v) for s, v in isolated.items()}
    isolated_ratios = {f"{a}/{b}": isolated_medians[a] / isolated_medians[b] for a, b in mpairs}

    # Sameness: every side's per-step losses and evaluation loss against the first side's, and
    # the memory pairs' losses against the timing pair's first steps of the same side.
    losses: dict[str, list[float]] = t0["losses"]
    eval_loss: dict[str, float] = t0["eval_loss"]
    ref = ran[0] if ran else None
    loss_diff = eval_diff = mem_diff = None
    if ref is not None:
        loss_diff = max(_max_diff(losses[s], losses[ref]) for s in ran)
        eval_diff = max(abs(eval_loss[s] - eval_loss[ref]) for s in ran)
        mem_evals = [rr[0]["eval_loss"] for runs in mem.values() for rr in runs]
        if mem_evals:
            eval_diff = max(eval_diff, max(mem_evals) - min(mem_evals))
        mem_diff = max(
            (
                _max_diff(rr[0]["losses"], losses[s])
                for s, runs in mem.items()
                if s in losses
                for rr in runs
            ),
            default=None,
        )
    n = args.rounds * args.steps_per_round
    result: dict[str, Any] = {
        "benchmark": "zero_vs_peers",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "sides": list(ran),
        "unavailable": unavailable,
        "medians_s": medians,
        "ratios": ratios,
        "paired_ratio_medians": paired,
        "min_ratios": min_ratios,
        "cpu_medians_s": cpu_medians,
        "cpu_ratios": cpu_ratios,
        "peak_rss_bytes": peak,
        "rss_increase_bytes": incr,
        "peak_rss_ratios": rss_ratios,
        "rss_increase_ratios": incr_ratios,
        "isolated_medians_s": isolated_medians,
        "isolated_ratios": isolated_ratios,
        "samples_s": samples,
        "cpu_samples_s": cpu_samples,
        "summary_s": {
            s: {"min": min(v), "max": max(v), "mean": statistics.fmean(v)}
            for s, v in samples.items()
        },
        "isolated_samples_s": isolated,
        "peak_rss_bytes_per_rank": peak_rank,
        "rss_increase_bytes_per_rank": incr_rank,
        "memory_runs": {
            s: [
                [
                    {
                        key: r[key]
                        for key in (
                            "rank",
                            "rss_baseline_bytes",
                            "peak_rss_bytes",
                            "rss_increase_bytes",
                            "rss_end_bytes",
                        )
                    }
                    for r in rr
                ]
                for rr in runs
            ]
            for s, runs in mem.items()
        },
        "memory_report": {
            s: [r.get("memory_report") for r in runs[-1]]
            for s, runs in mem.items()
            if s.startswith("longboat_")
        },
        "losses": losses,
        "eval_loss": eval_loss,
        "eval_loss_init": _eval_loss_init(args),
        "loss_reference_side": ref,
        "max_abs_loss_diff": loss_diff,
        "max_abs_eval_loss_diff": eval_diff,
        "max_abs_loss_diff_memory_vs_timing": mem_diff,
        "round_order": t0["round_order"],
        "memory_order": memory_order,
        "incidents": incidents,
        "config": {
            "model": {
                "name": "reference_gpt",
                **t0.get("model", {}),
                "parameters": t0.get("parameters"),
            },
            "optimizer": {"type": "AdamW", "lr": args.lr},
            "micro_batch": args.micro_batch,
            "seq_len": args.seq_len,
            "world_size": args.world_size,
            "threads_per_rank": args.threads,
            "warmup_steps_per_side": args.warmup,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "measured_steps_per_side": n,
            "memory_repeats": args.memory_repeats,
            "memory_steps_after_warmup": args.memory_steps,
            "longboat": {
                "zero2": {"strategy": "zero", "zero": {"stage": 2}},
                "zero3": {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["_Block"]}},
            },
            "fsdp2": {
                "fully_shard": "each model.blocks[i], then the root",
                "zero2": {"reshard_after_forward": False},
                "zero3": {"reshard_after_forward": True},
            },
            "deepspeed": {
                "zero2": _ds_config(args, 2),
                "zero3": _ds_config(args, 3),
                "accelerator": "cpu",
                "dist_backend": "gloo",
            },
            "order": "timing: all sides in one process pair, ABBA: side order rotates every "
            "round and flips every other round",
            "timing": "perf_counter per step per rank, all_reduce MAX over ranks",
            "cpu_timing": "process_time (all threads) per step per rank, all_reduce MAX",
            "memory": "one fresh process pair per side and repeat; ru_maxrss per rank after "
            "the steps (before evaluation); increase = that peak minus the RSS right "
            "after the model was built; median over repeats per rank, max over ranks",
            "backend": "gloo",
            "seed": args.seed,
        },
        "versions": versions("deepspeed"),
        "machine": machine(),
        "wall_time_s": wall,
    }
    everything = not args.only and not args.stage
    # A partial run must not overwrite the comparison, so it gets its own default file.
    suffix = "" if everything else f".{args.only or f'stage{args.stage}'}-only"
    out = args.out or DEFAULT_OUT.with_suffix(f"{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(
        f"reference GPT {t0.get('parameters', 0):,} params, micro-batch {args.micro_batch} x "
        f"{args.seq_len}, {args.world_size} ranks x {args.threads} thread(s), AdamW lr {args.lr:g}"
    )
    print(
        f"time: {n} measured steps per side ({args.rounds} rounds x {k}, ABBA, one process "
        f"pair, after {args.warmup} warm-up steps); memory: {args.memory_repeats} fresh "
        f"pair(s) per side, {args.warmup} + {args.memory_steps} steps"
    )
    print(
        f"{'side':<16} {'median s':>9} {'min':>7} {'max':>7} {'CPU s':>7} {'alone s':>8} "
        f"{'peak RSS MiB':>13} {'+RSS MiB':>9}  final loss  eval loss"
    )
    for s in ran:
        v = samples[s]
        alone = f"{isolated_medians[s]:8.4f}" if s in isolated_medians else f"{'-':>8}"
        pk = _mib(peak[s]) if s in peak else "-"
        inc = _mib(incr[s]) if s in incr else "-"
        print(
            f"{s:<16} {medians[s]:9.4f} {min(v):7.4f} {max(v):7.4f} {cpu_medians[s]:7.4f} "
            f"{alone} {pk:>13} {inc:>9}  {losses[s][-1]:10.6f} {eval_loss[s]:10.6f}"
        )
    for s, why in unavailable.items():
        print(f"{s:<16} not run: {why}")
    for line in incidents:
        print(f"incident: {line}")
    for s, reps in result["memory_report"].items():
        if reps and reps[0]:
            m, e = reps[0]["measured"], reps[0]["expected"]
            print(
                f"{s} memory_report rank 0: "
                + ", ".join(f"{c} {m[c] / 2**20:.1f} MiB (formula {e[c] / 2**20:.1f})" for c in m)
            )
    if ref is not None:
        print(
            f"max |loss difference| between sides, per step = {loss_diff:.3g}; eval loss = "
            f"{eval_diff:.3g}; memory pairs vs timing pair = "
            f"{mem_diff if mem_diff is None else format(mem_diff, '.3g')} "
            f"(eval loss before training {result['eval_loss_init']:.6f})"
        )
    for key in ratios:
        alone = f", alone {isolated_ratios[key]:.3f}" if key in isolated_ratios else ""
        print(
            f"ratio time ({key.replace('/', ' / ')}) = {ratios[key]:.3f}  "
            f"(median of per-round ratios {paired[key]:.3f}, of minima {min_ratios[key]:.3f}, "
            f"CPU {cpu_ratios[key]:.3f}{alone})"
        )
    for key in rss_ratios:
        print(
            f"ratio peak RSS ({key.replace('/', ' / ')}) = {rss_ratios[key]:.3f}  "
            f"(RSS increase {incr_ratios[key]:.3f})"
        )
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    """Time all sides in one process pair, then each alone for memory; write the report."""
    args = _parse_args(argv)
    if args.only:
        sides: tuple[str, ...] = (args.only,)
    elif args.stage:
        sides = tuple(s for s in SIDES if STAGE_OF[s] == args.stage)
    else:
        sides = SIDES
    if any(s.startswith("longboat_") for s in sides):
        import longboat

        if not hasattr(longboat, "initialize"):
            sys.exit("longboat.initialize is not available yet; run with --only fsdp2_zero2")
    incidents: list[str] = []
    t0 = time.perf_counter()
    timing = _spawn_with_retry(args, "timing", sides, incidents, may_fail=False)
    assert timing is not None
    unavailable: dict[str, str] = dict(timing[0]["unavailable"])
    for s, why in unavailable.items():
        print(f"{s} not run: {why}", flush=True)
    for s, v in timing[0]["samples_s"].items():
        print(f"time: {s:<16} median {statistics.median(v):.4f} s", flush=True)
    print(f"timing pair done ({time.perf_counter() - t0:.1f} s)", flush=True)

    memory: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in sides if s not in unavailable}
    memory_order: list[list[str]] = []
    for rep in range(args.memory_repeats):
        names = tuple(memory)
        memory_order.append(list(names if rep % 2 == 0 else reversed(names)))
        for side in memory_order[-1]:
            t = time.perf_counter()
            ranks = _spawn_with_retry(
                args, "memory", (side,), incidents, may_fail=_lib(side) == "deepspeed"
            )
            why = (
                "its process pair died twice"
                if ranks is None
                else next((x["unavailable"] for x in ranks if x.get("unavailable")), None)
            )
            if why or ranks is None:
                print(f"memory: {side} not measured: {why}", flush=True)
                unavailable[f"{side} (memory)"] = str(why)
                continue
            memory[side].append(ranks)
            print(
                f"memory {rep}: {side:<16} peak RSS "
                f"{_mib(max(x['peak_rss_bytes'] for x in ranks))} MiB  alone median "
                f"{statistics.median(ranks[0]['samples_s']):.4f} s  "
                f"({time.perf_counter() - t:.1f} s)",
                flush=True,
            )
    wall = time.perf_counter() - t0
    _report(args, timing, memory, unavailable, memory_order, wall, incidents)
    print(f"total wall time {wall:.1f} s")


if __name__ == "__main__":
    main()
