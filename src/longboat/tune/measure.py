"""Measuring a bench model's chosen candidates: one ``longboat bench`` run builds them all in
one launch of ranks and steps them side by side, then each alone for its memory ([Note: tune
phases] in search.py, step 5)."""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from longboat.bench.runner import MEMORY_STEPS, BenchProgressFn, BenchSettings, run_bench
from longboat.bench.sides import CONFIG_PREFIX

if TYPE_CHECKING:
    from longboat.tune.results import Outcome, TuneSettings
    from longboat.tune.space import Candidate

Runner = Callable[[BenchSettings, BenchProgressFn], dict[str, Any]]
#: Rough costs of a bench launch and of building a side in it, to decide what can be measured
#: in the time left (the bench's deadline holds the line when they are wrong).
LAUNCH_S = 3.0
BUILD_S = 2.0
TRACKED = 1.5  # a memory launch's steps run under the live-tensor tracker: slower


def default_runner(settings: BenchSettings, on_progress: BenchProgressFn) -> dict[str, Any]:
    """The bench itself."""
    return run_bench(settings, on_progress)


def measuring_cost_s(predicted_s: float, warmup: int, steps: int) -> float:
    """Estimated seconds to measure one candidate: its part of the timing launch and its own
    memory launch."""
    timing = BUILD_S + (warmup + steps) * predicted_s
    memory = LAUNCH_S + BUILD_S + (warmup + MEMORY_STEPS) * predicted_s * TRACKED
    return timing + memory


def measured(row: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of a bench row."""
    live = row.get("live_peak_bytes_per_rank")
    rss = row.get("peak_rss_bytes_per_rank")
    base = row.get("rss_after_import_bytes_per_rank")
    return {
        "step_time_median_s": row["step_time_median_s"],
        "step_time_iqr_s": row["step_time_iqr_s"],
        "step_times_s": row["step_times_s"],
        "measured_steps": row["measured_steps"],
        "losses": row["losses"],
        "live_peak_bytes_per_rank": live,
        "peak_rss_bytes_per_rank": rss,
        "rss_increase_bytes_per_rank": (
            [p - b for p, b in zip(rss, base, strict=True)] if rss and base else None
        ),
        "state_bytes_per_rank": row.get("state_bytes_per_rank"),
        "paired": True,  # measured in the same rounds as the others: paired ratios hold
    }


def bench_measure(
    chosen: list[Outcome],
    settings: TuneSettings,
    runner: Runner | None,
    on_bench: BenchProgressFn | None,
    deadline: float,
) -> dict[str, Any]:
    """Measure ``chosen`` in one bench run that stops starting work at ``deadline`` (wall
    clock); sets each one's ``measured``. Returns the bench's result."""
    n = settings.world_size
    configs = {}
    for o in chosen:
        assert o.candidate is not None
        configs[CONFIG_PREFIX + o.name] = for_measuring(o.candidate)
    bench_settings = BenchSettings(
        model=settings.model,
        strategies=(),
        peers=(),
        world_sizes=(n,),
        micro_batch=settings.batch // n,  # the step's samples over the ranks (see ConfigSide)
        seq_len=settings.seq_len,
        warmup=settings.warmup,
        steps=settings.steps,
        memory=True,
        configs=configs,
        live_peak=True,
        deadline=deadline,
    )
    try:
        bench = (runner or default_runner)(bench_settings, on_bench or (lambda *_: None))
    finally:  # the measuring runs' offload files are theirs only
        for data in configs.values():
            where = data.get("zero", {}).get("offload_optimizer", {}).get("path")
            if where:
                shutil.rmtree(where, ignore_errors=True)
    rows = {r["side"].removeprefix(CONFIG_PREFIX): r for r in bench["rows"]}
    for o in chosen:
        row = rows.get(o.name)
        if row is None:
            o.reason = "the bench returned no row for it"
            continue
        o.status = "measured"
        o.measured = measured(row)
    return bench


def for_measuring(c: Candidate) -> dict[str, Any]:
    """The candidate's config for the bench: with offload, a directory of its own under the
    offload directory, as two candidates in one process must not share files."""
    data = copy.deepcopy(c.mapping)
    zero = data.get("zero", {})
    if zero.get("offload_optimizer", {}).get("device") == "disk":
        where = tempfile.mkdtemp(prefix="tune-", dir=zero["offload_optimizer"]["path"])
        zero["offload_optimizer"]["path"] = where
        zero["offload_param"]["path"] = where
    return data
