"""Step time of longboat's step against a plain PyTorch step, on one device, in bf16.

The sides train the same GPT (:class:`longboat.models.GPT`, built from the same seed) on the
same batch, each with its own model and AdamW:

- ``plain``: forward under ``torch.autocast`` to bf16, the loss in fp32, backward,
  ``opt.step()``, ``zero_grad`` (:func:`gpucheck.plain.step_fn`);
- ``plain-read-loss``: the same, copying the loss to the host every step as a script that
  prints it does (longboat's ``engine.backward`` reads it for its step loss), so that a gap
  between longboat and ``plain`` can be told apart from that one copy;
- ``single`` and ``replicate`` (a world of one, no process group): ``engine(x)`` (the same
  autocast), ``engine.backward(loss)``, ``engine.step()``;
- ``zero-2`` and ``zero-2+bf16``: ZeRO-2 at a world of one, the second with bf16 parameters
  (``[precision] param_dtype = "bf16"``: the forward reads a bf16 copy, fp32 masters step).

Each measured step is bracketed by a device synchronisation, so it is the whole step's time.
Warm-up steps first, then rounds in which every side runs one step, in an order reversed every
round (ABBA), so a drift of the machine falls on every side alike. The ratio of the medians to
``plain`` is reported, and the median of the per-round ratios. ``compiled`` repeats ``plain``
and ``single`` with every transformer block compiled (``block.compile()``, in place, so names
stay), warm-up included the compilation, and adds ``single+compile``: the blocks compiled by
longboat itself (``[compile] enabled = true``).

After the timed rounds of the eager task, ``torch.profiler`` records a few steps of ``plain``,
``single``, ``replicate`` and ``zero-2`` each, and the result keeps both tables of the
operators' self time on the device and on the host, so that where longboat's extra time goes
can be read off a GPU run; with ``GPU_CHECK_TRACE_DIR`` set, each side's timeline too
(``trace_<side>.json.gz``, for chrome://tracing or Perfetto).
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpucheck import plain
from gpucheck.launch import RankContext, Task

# A GPT-2-small-shaped model: a step of some tens of milliseconds on a current GPU, large
# enough that per-step overheads of a few hundred microseconds show as percent, not noise.
GPU_MODEL = {"vocab_size": 32768, "d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024}
GPU_BATCH = 16
DRY_MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16}
DRY_BATCH = 2
GOAL = 1.03  # longboat's step at most 3% slower than the plain one


def tasks(dry: bool) -> list[Task]:
    """Eager first (its figures are kept if compiling runs out of time), then compiled."""
    args: dict[str, Any] = {
        "model": DRY_MODEL if dry else GPU_MODEL,
        "micro_batch": DRY_BATCH if dry else GPU_BATCH,
        "warmup": 1 if dry else 5,
        "rounds": 3 if dry else 20,
        "dtype": "bf16",
    }
    # In a dry run dynamo traces and runs the graphs as they are (no code generation): the
    # code path is exercised in seconds; the GPU run uses inductor, as a user gets by default.
    compiled = dict(
        args, sides=["plain", "single", "single+compile"], compile="eager" if dry else "inductor"
    )
    compiled["warmup"] = 2 if dry else 3  # the first compiles
    eager = dict(
        args,
        sides=["plain", "plain-read-loss", "single", "replicate", "zero-2", "zero-2+bf16"],
        profile=["plain", "single", "replicate", "zero-2"],
    )
    return [
        Task("eager", "gpucheck.steptime:measure", eager, 180.0),
        Task("compiled", "gpucheck.steptime:measure", compiled, 300.0),
    ]


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def measure(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """Build every side, warm up, then time alternating rounds; the medians and ratios."""
    import longboat
    from longboat.models import GPT, gpt_loss

    device = torch.device(ctx.device)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args["dtype"]]
    sides = args.get("sides", ["plain", "plain-read-loss", "single", "replicate"])
    backend = args.get("compile")
    gen = torch.Generator(device=device).manual_seed(0)
    vocab, seq = args["model"]["vocab_size"], args["model"]["seq_len"]
    tokens = torch.randint(0, vocab, (args["micro_batch"], seq + 1), generator=gen, device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def model(by_hand: bool = True) -> torch.nn.Module:
        torch.manual_seed(0)
        m = GPT(**args["model"])
        if backend is not None and by_hand:
            for block in m.blocks:
                block.compile(backend=backend)
        return m

    steps: dict[str, Callable[[], None]] = {}
    engines = []
    plain_model = None
    for side in sides:
        if side.startswith("plain"):
            if plain_model is None:  # both plain sides step one model: the same work
                plain_model = model().to(device)
                plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-4)
            read = side == "plain-read-loss"
            steps[side] = plain.step_fn(plain_model, plain_opt, (x, y), gpt_loss, dtype, read)
            continue
        # "single+compile": longboat compiles the blocks itself ([compile] in the config);
        # "zero-2+bf16": ZeRO-2 with bf16 parameters
        strategy, _, how = side.partition("+")
        m = model(by_hand=how != "compile")
        name, _, stage = strategy.partition("-")
        cfg: dict[str, Any] = {
            "strategy": name,
            "precision": {"dtype": args["dtype"]},
            "batch": {"micro_batch_size": args["micro_batch"]},
            "log": {"progress": False, "level": "WARNING"},
        }
        if stage:
            cfg["zero"] = {"stage": int(stage)}
        if how == "bf16":
            cfg["precision"]["param_dtype"] = "bf16"
        if how == "compile":
            cfg["compile"] = {"enabled": True, "backend": backend}
        engine = longboat.initialize(m, torch.optim.AdamW(m.parameters(), lr=1e-4), cfg)
        engines.append(engine)

        def step(engine: Any = engine) -> None:
            engine.backward(gpt_loss(engine(x), y))
            engine.step()

        steps[side] = step
    sync = _sync(device)
    t0 = time.perf_counter()
    for _ in range(args["warmup"]):
        for fn in steps.values():
            fn()
    sync()
    warmup_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(args["rounds"]):
        for side in sides if r % 2 == 0 else reversed(sides):
            sync()
            t = time.perf_counter()
            steps[side]()
            sync()
            times[side].append(time.perf_counter() - t)
    profiles = {side: _profile(side, steps[side], device) for side in args.get("profile", [])}
    for engine in engines:
        engine.close()
    base = statistics.median(times["plain"])
    out: dict[str, Any] = {
        "sides": sides,
        "compile_backend": backend,
        "warmup_s": warmup_s,
        "median_s": {s: statistics.median(v) for s, v in times.items()},
        "ratio_of_medians": {s: statistics.median(v) / base for s, v in times.items()},
        "median_round_ratio": {
            s: statistics.median(a / b for a, b in zip(v, times["plain"], strict=True))
            for s, v in times.items()
        },
        "times_s": times,
        "goal_ratio": GOAL,
    }
    out["within_goal"] = {
        s: out["ratio_of_medians"][s] <= GOAL for s in sides if not s.startswith("plain")
    }
    if device.type == "cuda":
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    if profiles:
        out["profile"] = profiles
    return out


PROFILED_STEPS = 3


def _profile(side: str, step: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """``PROFILED_STEPS`` steps under ``torch.profiler``: the operators' self time per step on
    the device and on the host, as tables, and the totals; the timeline into
    ``$GPU_CHECK_TRACE_DIR/trace_<side>.json.gz`` when that is set."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync = _sync(device)
    sync()
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        sync()
    trace_dir = os.environ.get("GPU_CHECK_TRACE_DIR")
    if trace_dir:
        raw = Path(trace_dir) / f"trace_{side.replace('+', '_')}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
    events = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return {
        "steps": PROFILED_STEPS,
        "device_table": events.table(sort_by=sort, row_limit=30, max_name_column_width=60),
        "host_table": events.table(
            sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
        ),
        "kernel_count": sum(e.count for e in events if getattr(e, "self_device_time_total", 0) > 0),
    }
