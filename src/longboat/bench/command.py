"""``longboat bench``: check the flags, run with a progress display, write the outputs."""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from rich.console import Console

from longboat.bench.models import resolve_model
from longboat.bench.runner import BenchSettings, run_bench
from longboat.bench.sides import LONGBOAT_SIDES, PEERS
from longboat.observe.progress import task_progress
from longboat.strategies.registry import zero_stage


class BenchUsageError(ValueError):
    """A bad flag; the message names it, the value and the fix."""


def _names(flag: str, value: str, valid: tuple[str, ...], allow_empty: bool) -> tuple[str, ...]:
    # "zero-2" as `longboat plan` spells it is accepted too.
    items = tuple(
        f"zero{stage}" if (stage := zero_stage(x)) else x.strip()
        for x in value.split(",")
        if x.strip()
    )
    if not items and not allow_empty:
        raise BenchUsageError(f"{flag} is empty: give one or more of {','.join(valid)}")
    for x in items:
        if x not in valid:
            close = difflib.get_close_matches(x, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise BenchUsageError(
                f"{flag} has unknown value {x!r}{hint}: choose from {','.join(valid)}"
            )
    return tuple(dict.fromkeys(items))


def settings_from_flags(
    *,
    model: str,
    strategies: str,
    peers: str,
    world_sizes: str,
    micro_batch: int,
    seq_len: int,
    warmup: int,
    steps: int,
    scaling: str,
    threads: int,
    memory: bool,
    pipeline_micro_batches: int = 4,
) -> BenchSettings:
    """Validate the flags into :class:`BenchSettings`; :class:`BenchUsageError` names the flag."""
    try:
        resolve_model(model, seq_len)  # here, so a bad --model fails before any rank starts
    except ValueError as e:
        raise BenchUsageError(str(e)) from None
    try:
        sizes = tuple(int(x) for x in world_sizes.split(",") if x.strip())
    except ValueError:
        raise BenchUsageError(
            f"--world-sizes {world_sizes!r} is not a list of integers: e.g. 1,2"
        ) from None
    if not sizes or min(sizes) < 1:
        raise BenchUsageError(
            f"--world-sizes {world_sizes!r} is invalid: give integers >= 1, e.g. 1,2"
        )
    for flag, v, lo in (
        ("--micro-batch", micro_batch, 1),
        ("--seq-len", seq_len, 1),
        ("--warmup", warmup, 1),
        ("--steps", steps, 1),
        ("--threads", threads, 1),
        ("--pipeline-micro-batches", pipeline_micro_batches, 1),
    ):
        if v < lo:
            raise BenchUsageError(f"{flag} {v} is invalid: use {lo} or more")
    if scaling not in ("weak", "strong"):
        raise BenchUsageError(f"--scaling {scaling!r} is unknown: choose weak or strong")
    s = BenchSettings(
        model=model,
        strategies=_names("--strategies", strategies, LONGBOAT_SIDES, False),
        peers=_names("--peers", peers, PEERS, True),
        world_sizes=tuple(sorted(set(sizes))),
        micro_batch=micro_batch,
        seq_len=seq_len,
        warmup=warmup,
        steps=steps,
        scaling=scaling,  # type: ignore[arg-type]
        threads=threads,
        memory=memory,
        pipeline_micro_batches=pipeline_micro_batches,
    )
    if "pipeline" in s.strategies:
        _check_pipeline(s)
    if "parameter_server" in s.strategies:
        for n in s.world_sizes:
            gb = s.global_batch(n)
            if n > 1 and gb % (n - 1):
                raise BenchUsageError(
                    f"--strategies parameter_server: at world size {n} the last rank serves "
                    f"and {n - 1} workers split the global batch of {gb} samples, which does "
                    "not divide: change --micro-batch or --world-sizes"
                )
    if scaling == "strong":
        gb = s.global_batch(1)
        bad = [n for n in s.world_sizes if gb % n]
        if bad:
            raise BenchUsageError(
                f"--scaling strong splits a global batch of {gb} (--micro-batch "
                f"x the largest world size) over the ranks; it does not divide "
                f"by world size {bad[0]}: change --world-sizes"
            )
    return s


def _check_pipeline(s: BenchSettings) -> None:
    """The pipeline side splits each step's global batch into ``--pipeline-micro-batches``
    equal micro-batches, and 1F1B needs at least as many micro-batches as stages."""
    m = s.pipeline_micro_batches
    for n in s.world_sizes:
        if n < 2:
            continue
        gb = s.global_batch(n)
        if gb % m:
            raise BenchUsageError(
                f"--pipeline-micro-batches {m} does not divide the global batch of {gb} "
                f"samples at world size {n}: choose a divisor of {gb}, or change --micro-batch"
            )
        if m < n:
            raise BenchUsageError(
                f"--pipeline-micro-batches {m} is fewer than the {n} stages at world size {n}; "
                f"1F1B needs at least one micro-batch per stage: use {n} or more"
            )


def bench(s: BenchSettings, out: Path, console: Console | None = None) -> dict[str, Path]:
    """Run ``s`` with a live progress display; print the table; write the files under ``out``."""
    from longboat.bench import report

    console = console or Console(stderr=True)
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchUsageError(
            "longboat bench draws its chart with matplotlib, which is not "
            "installed: pip install 'longboat[bench]'"
        )
    with task_progress(console) as progress:
        task = progress.add_task("starting ranks", total=None)

        last: list[tuple[int, str]] = []

        def on_progress(n: int, phase: str, side: str, done: int, total: int) -> None:
            progress.update(
                task, description=f"world size {n} | {phase} | {side}", completed=done, total=total
            )
            if not console.is_terminal and last[-1:] != [(n, phase)]:
                # No live bar in a pipe or a log: one line per launch instead.
                last.append((n, phase))
                console.print(f"world size {n}: {phase} ({total} steps)")

        raw = run_bench(s, on_progress)
    result = report.finish(raw)
    report.print_table(result)
    paths = report.write_all(result, out)
    for kind, path in paths.items():
        console.print(f"wrote {kind}: {path}")
    return paths
