"""``longboat tune``: check the flags, search with a progress display, write the chosen config."""

from __future__ import annotations

import datetime
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from longboat.observe.progress import task_progress
from longboat.tune.search import TuneResult, TuneSettings, search
from longboat.tune.space import COMM_DTYPES
from longboat.tune.verify import NOISE_BAND


class TuneUsageError(ValueError):
    """A bad flag; the message names it, the value and the fix."""


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """``10m``, ``90s``, ``1h`` or a plain number of seconds, as seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*", text)
    if not m or float(m[1]) <= 0:
        raise TuneUsageError(f"--time {text!r} is not a duration; write e.g. 10m, 90s or 600")
    return float(m[1]) * _UNITS[m[2] or "s"]


def _numbers(flag: str, text: str, kind: type) -> tuple[Any, ...]:
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        example = "1,2,4" if kind is int else "25,5"
        raise TuneUsageError(
            f"{flag} {text!r} is not a list of positive numbers: write e.g. {example}"
        )
    return tuple(dict.fromkeys(values))


@dataclass(frozen=True)
class Flags:
    """The command line as given (strings where the CLI takes text)."""

    model: str = "reference-gpt"
    world_size: int = 2
    budget: str | None = None
    global_batch: int | None = None
    time: str = "10m"
    top: str = "3"  # a number, or "all": every candidate that fits
    seq_len: int = 128
    warmup: int = 1
    steps: int = 5
    micro_batches: str | None = None
    bucket_mb: str = "25,5"
    recompute: bool = True
    comm_dtypes: str = "fp32"
    precisions: str = "auto"
    offload_dir: Path | None = None
    noise_band: float = NOISE_BAND
    pp: str = "auto"  # degrees, e.g. 1,2; auto: what the model can take
    tp: str = "auto"
    schedules: str = "1f1b,zb-h1"
    script: Path | None = None  # a user's training script, tuned instead of --model
    script_args: tuple[str, ...] = ()
    plan_model: str | None = None  # package.module:callable, the planner's view of the script


def parse_top(text: str) -> int | None:
    """``--top``: a positive number, or ``all`` (None: every candidate that fits)."""
    if text.strip().lower() == "all":
        return None
    try:
        top = int(text)
    except ValueError:
        top = 0
    if top < 1:
        raise TuneUsageError(f"--top {text} is invalid: use 1 or more, or all")
    return top


def _precisions(text: str) -> tuple[str, ...]:
    """``--precisions``: names from :data:`~longboat.tune.space.PRECISIONS`, or ``auto``: every
    one where CUDA computes in bf16, else fp32 alone (on a CPU without bf16 matrix units bf16
    is slower, and measuring it would spend the budget on candidates that lose)."""
    import torch

    from longboat.tune.space import PRECISIONS

    if text.strip().lower() == "auto":
        fast = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return tuple(PRECISIONS) if fast else ("fp32",)
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in names if x not in PRECISIONS] or ([] if names else [text])
    if bad:
        raise TuneUsageError(
            f"--precisions has unknown value {bad[0]!r}: choose from {','.join(PRECISIONS)}, "
            "or auto"
        )
    return names


def _degrees(flag: str, text: str) -> tuple[int, ...] | None:
    """``--pp``/``--tp``: ``auto`` (None), or degrees such as ``1,2``."""
    if text.strip().lower() == "auto":
        return None
    return tuple(int(x) for x in _numbers(flag, text, int))


def _schedules(text: str) -> tuple[str, ...]:
    from typing import get_args

    from longboat.config.sections import PipelineConfig

    known = get_args(PipelineConfig.model_fields["schedule"].annotation)
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in names if x not in known] or ([] if names else [text])
    if bad:
        raise TuneUsageError(
            f"--schedules has unknown value {bad[0]!r}: choose from {','.join(known)}"
        )
    return names


def _script(f: Flags) -> None:
    """A script, its planner's model and --model, checked together."""
    if f.script is None:
        if f.plan_model is not None:
            raise TuneUsageError(
                f"--plan-model {f.plan_model!r} describes a script's model: give the script "
                "(longboat tune train.py --plan-model train:build_model -- ARGS)"
            )
        return
    if f.model != Flags.model:
        raise TuneUsageError(
            f"--model {f.model!r} and the script {str(f.script)!r}: a search tunes one of "
            "them; drop --model to tune the script"
        )
    if not f.script.is_file():
        raise TuneUsageError(f"script {str(f.script)!r} does not exist: give a Python file")


def settings_from_flags(f: Flags) -> TuneSettings:
    """Validate the flags into :class:`TuneSettings`; :class:`TuneUsageError` names the flag."""
    from longboat.bench.models import resolve_model
    from longboat.plan.render import parse_bytes
    from longboat.plan.target import PlanInputError

    for flag, v in (
        ("--world-size", f.world_size),
        ("--steps", f.steps),
        ("--warmup", f.warmup),
        ("--seq-len", f.seq_len),
    ):
        if v < 1:
            raise TuneUsageError(f"{flag} {v} is invalid: use 1 or more")
    _script(f)
    try:
        resolve_model(f.model, f.seq_len)  # here, so a bad --model fails before any work
    except ValueError as e:
        raise TuneUsageError(str(e)) from None
    budget = None
    if f.budget is not None:
        try:
            budget = parse_bytes(f.budget)
        except PlanInputError as e:
            raise TuneUsageError(str(e)) from None
        if budget <= 0:
            raise TuneUsageError(f"--budget {f.budget!r} is not positive; write e.g. 400MiB")
    batch = f.global_batch if f.global_batch is not None else 8 * f.world_size
    if batch < 1 or batch % f.world_size:
        raise TuneUsageError(
            f"--global-batch {batch} does not split over --world-size {f.world_size}: give a "
            f"positive multiple of {f.world_size}"
        )
    comm = tuple(dict.fromkeys(x.strip() for x in f.comm_dtypes.split(",") if x.strip()))
    bad = [x for x in comm if x not in COMM_DTYPES] or ([] if comm else [f.comm_dtypes])
    if bad:
        raise TuneUsageError(
            f"--comm-dtypes has unknown value {bad[0]!r}: choose from {','.join(COMM_DTYPES)}"
        )
    precisions = _precisions(f.precisions)
    if not 0 <= f.noise_band < 1:
        raise TuneUsageError(
            f"--noise-band {f.noise_band} is invalid: give a fraction from 0 to below 1, e.g. 0.05"
        )
    settings = TuneSettings(
        model=f.model,
        world_size=f.world_size,
        global_batch=batch,
        budget=budget,
        time_s=parse_duration(f.time),
        top=parse_top(f.top),
        seq_len=f.seq_len,
        warmup=f.warmup,
        steps=f.steps,
        micro_sizes=_numbers("--micro-batches", f.micro_batches, int) if f.micro_batches else (),
        buckets_mb=_numbers("--bucket-mb", f.bucket_mb, float),
        recompute=f.recompute,
        comm_dtypes=comm,
        precisions=precisions,
        offload_dir=None if f.offload_dir is None else str(f.offload_dir),
        noise_band=f.noise_band,
        pp=_degrees("--pp", f.pp),
        tp=_degrees("--tp", f.tp),
        schedules=_schedules(f.schedules),
        script=None if f.script is None else str(f.script),
        script_args=tuple(f.script_args),
        plan_model=f.plan_model,
    )
    if settings.plan_model is not None:
        from longboat.tune.script import script_target

        try:
            script_target(settings)  # here, so a bad --plan-model fails before any work
        except PlanInputError as e:  # the planner's words, about the flag given here
            raise TuneUsageError(str(e).replace("--model", "--plan-model", 1)) from None
    return settings


def header(result: TuneResult) -> list[str]:
    """The comment lines at the top of the written config: what was chosen and measured."""
    from longboat.bench.report import versions

    s = result.settings
    w = result.outcome(result.winner or "")
    assert w.measured is not None
    m = w.measured
    budget = "no budget" if s.budget is None else f"budget {s.budget / 2**20:,.1f} MiB per rank"
    live = m["live_peak_bytes_per_rank"]
    rss = m["peak_rss_bytes_per_rank"]
    grew = m["rss_increase_bytes_per_rank"]
    memory = "Memory per rank: not planned"
    if w.planned is not None:
        memory = f"Memory per rank: planned peak {w.planned.peak / 2**20:,.1f} MiB (live tensors)"
    if live:
        memory += f"; measured live-tensor peak {max(live) / 2**20:,.1f} MiB"
    if rss and grew:
        memory += (
            f", peak RSS {max(rss) / 2**20:,.0f} MiB ({max(grew) / 2**20:,.0f} MiB above the "
            "RSS before the model was built)"
        )
    elif rss:
        memory += f", peak RSS {max(rss) / 2**20:,.0f} MiB"
    v = versions()
    what = s.model if s.script is None else s.script
    how = "side by side with" if m["paired"] else "one run after another, with"
    pred = "" if w.prediction is None else f" (predicted {w.prediction.total_s:.3f} s)"
    return [
        f"Written by longboat tune: {what} at {s.world_size} rank(s), global batch {s.batch}, "
        f"{budget}.",
        f"Chosen: {w.name}. Measured median step {m['step_time_median_s']:.3f} s over "
        f"{m['measured_steps']} steps, {how} {len(result.launched) - 1} other "
        f"candidate(s){pred}.",
        memory + ".",
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC with torch "
        f"{v['torch']}, longboat {v['longboat']} ({v['commit'] or 'not a checkout'}).",
        "Load with longboat.load_config(path); the batch triple holds at this world size only.",
    ]


def run(
    flags: Flags, out: Path, as_json: bool, console: Console | None = None
) -> tuple[str, int, dict[str, Any]]:
    """Search with a live progress display; write the chosen config under ``out``. Returns the
    report (text or JSON), the exit status (0 with a winner, 1 without) and the report JSON."""
    from longboat.tune import output, report

    settings = settings_from_flags(flags)
    console = console or Console(stderr=True)
    with task_progress(console) as progress:
        task = progress.add_task("building the search space", total=None)
        said: list[str] = []

        def say(what: str, done: int, total: int) -> None:
            progress.update(task, description=what, completed=done, total=total)
            phase = what.split(" ")[0]
            if not console.is_terminal and said[-1:] != [phase]:
                said.append(phase)  # no live bar in a pipe or a log: a line per phase
                console.print(f"tune: {what} ({total})")

        def on_bench(_n: int, phase: str, side: str, done: int, total: int) -> None:
            say(f"measuring | {phase} | {side.removeprefix('config:')}", done, total)

        result = search(settings, say=say, on_bench=on_bench)
    outputs: dict[str, Any] = {}
    if result.winner is not None:
        toml, ds, why = output.write(result.outcome(result.winner).mapping, out, header(result))
        outputs["config"] = str(toml)
        outputs["deepspeed"] = str(ds) if ds else f"not written: {why}"
    data = report.to_json(result, outputs)
    text = json.dumps(data, indent=2) if as_json else report.render(result, outputs)
    return text, 0 if result.winner else 1, data
