"""The search: plan every candidate, drop what does not fit, rank the rest by the cost model,
measure the best few side by side, and choose the fastest measured one that fits.

[Note: tune phases] In order, each bounded by the ``--time`` budget counted from the start:

1. the search space (``space.py``): every combination the config accepts, on every layout
   (pipeline stages, tensor-parallel ranks) the model can take ([Note: capabilities] in
   ``planning.py``);
2. the planner on every candidate (``longboat.plan.simulate``, fake tensors, nothing
   allocated): its predicted peak per rank; a candidate over the budget is *dropped* and is
   never launched, whatever else happens; a candidate a strategy refuses at setup is invalid;
   one the planner cannot run (an operator fake tensors cannot take...) is *unplanned*, with
   its error, and is not launched either (nothing says it fits).
   Planning takes at most ``PLAN_SHARE`` of ``--time`` (a second or two per candidate adds up
   over a large space), the rest being for the rates and measuring; it goes round the
   layouts and strategies, each one's plainest candidates first (:func:`promising_first`), so
   that what is
   planned in the time spans them, and what is not is reported so;
3. this machine's rates (``machine.py``, a few seconds), when anything fits;
4. the cost model (``cost.py``) on what fits, fastest first;
5. the first ``--top`` of them whose estimated measuring time still fits the time left are
   measured (a user's script: one run of it per candidate while the time lasts, [Note: tuning
   a script] in ``script.py``; nothing is planned without the planner's view of its model,
   and the candidates are measured in planning order), a bench model in one bench run
   (``longboat.bench.run_bench``: all of them built in one launch of ranks, single steps
   alternating, medians; then each alone for its memory, with the live-tensor peak the planner
   predicts and peak RSS). The bench's deadline is the end of the
   time budget: no round and no memory launch starts after it;
6. the winner: the measured candidate with the lowest median step whose measured live-tensor
   peak is within the budget (every one of them was predicted to fit);
7. with ``--top all`` (``top=None``), every fitting candidate was measured (as the time allowed),
   and ``verify.py`` checks what the default ``--top`` would have chosen against all of them
   ([Note: verifying the choice]).

The planner, the work counter, the rates, the runner and the clock can be injected, which the
tests use to count launches, to rank synthetic candidates and to time phases without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from longboat.bench.models import resolve_model
from longboat.bench.runner import BenchProgressFn
from longboat.config.errors import ConfigError
from longboat.plan.target import PlanInputError, Target
from longboat.tune.cost import Rates, predict
from longboat.tune.measure import LAUNCH_S, Runner, bench_measure, measuring_cost_s
from longboat.tune.planning import (
    Planner,
    WorkOf,
    default_planner,
    default_work,
    layouts,
    planner_for,
    promising_first,
    work_for,
)
from longboat.tune.results import Outcome, Status, TuneResult, TuneSettings
from longboat.tune.script import measure_script, script_target
from longboat.tune.space import DEFAULT_BUCKETS_MB, Invalid, build_space
from longboat.tune.target import plan_target
from longboat.tune.verify import DEFAULT_TOP, paired_ratio, verify

#: The share of ``--time`` planning may take ([Note: tune phases]).
PLAN_SHARE = 0.5
Say = Callable[[str, int, int], None]  # (what, done, total)

__all__ = [
    "PLAN_SHARE",
    "Outcome",
    "Planner",
    "Status",
    "TuneResult",
    "TuneSettings",
    "WorkOf",
    "default_planner",
    "default_work",
    "promising_first",
    "search",
]


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def search(
    settings: TuneSettings,
    *,
    planner: Planner | None = None,
    work_of: WorkOf | None = None,
    rates: Rates | None = None,
    runner: Runner | None = None,
    say: Say | None = None,
    on_bench: BenchProgressFn | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> TuneResult:
    """Run the search of [Note: tune phases] and return what it found."""
    t0 = clock()
    wall_deadline = time.time() + settings.time_s
    say = say or (lambda *_: None)
    phases: dict[str, float] = {}
    n = settings.world_size
    target: Target | None
    if settings.script is None:
        spec = resolve_model(settings.model, settings.seq_len)
        target, units, info = plan_target(spec), spec.unit_classes, dict(spec.info)
    else:
        target, units = script_target(settings), ()
        info = {"script": settings.script, "args": list(settings.script_args)}
    lays, notes = layouts(
        None if target is None else target.build, n, settings.pp, settings.tp, settings.schedules
    )
    if target is None:
        notes.append(
            "measure-only: no --plan-model, so nothing was planned; the candidates were "
            "measured in planning order while --time lasted"
        )

    def left() -> float:
        return settings.time_s - (clock() - t0)

    def lap(name: str, since: float) -> float:
        now = clock()
        phases[name] = now - since
        return now

    buckets = settings.buckets_mb or DEFAULT_BUCKETS_MB
    space = build_space(
        n,
        settings.batch,
        micro_sizes=settings.micro_sizes or None,
        buckets_mb=buckets,
        recompute_classes=units if settings.recompute else (),
        comm_dtypes=settings.comm_dtypes,
        offload_dir=settings.offload_dir,
        precisions=settings.precisions,
        layouts=lays,
    )
    outcomes = [_invalid(x) for x in space.invalid]
    t = lap("space", t0)

    fitting: list[Outcome] = []
    ordered = promising_first(space.candidates, buckets)
    if target is None:  # measure-only: in planning order, nothing known to drop
        fitting = [Outcome(c.name, "not measured", "", c, c.mapping) for c in ordered]
        outcomes += fitting
        ordered = []
    planner = planner or (planner_for(target, n) if target is not None else None)
    for i, c in enumerate(ordered):
        if clock() - t0 > PLAN_SHARE * settings.time_s:
            why = (
                f"time: not planned; planning had used its share of --time ({i} of {len(ordered)})"
            )
            outcomes.append(Outcome(c.name, "not measured", why, c, c.mapping))
            continue
        say(f"planning {c.name}", i, len(ordered))
        assert planner is not None
        try:
            planned = planner(c)
        except (ConfigError, PlanInputError) as e:  # a strategy refused it at setup
            outcomes.append(Outcome(c.name, "invalid", str(e), c, c.mapping))
            continue
        except Exception as e:  # the planner's limit, not the candidate's: said in its row
            from longboat.plan.planner import one_line

            why = f"the planner could not plan it: {one_line(e)}"
            outcomes.append(Outcome(c.name, "unplanned", why, c, c.mapping))
            continue
        o = Outcome(c.name, "not measured", "", c, c.mapping, planned)
        if settings.budget is not None and planned.peak > settings.budget:
            o.status = "dropped"  # and never launched: [Note: tune phases]
            o.reason = f"over budget by {_mib(planned.peak - settings.budget)}"
        else:
            fitting.append(o)
        outcomes.append(o)
    t = lap("plan", t)

    planned_fits = [o for o in fitting if o.planned is not None]
    if planned_fits and rates is None:
        from longboat.tune import machine

        say("measuring this machine", 0, 1)
        low = any(o.candidate is not None and o.candidate.precision != "fp32" for o in fitting)
        rates = machine.measure(n, settings.offload_dir, bf16=low)
    t = lap("rates", t)
    if planned_fits:
        assert target is not None and rates is not None
        work_of = work_of or work_for(target)
        for o in planned_fits:
            fit = o.candidate
            assert fit is not None and o.planned is not None
            o.prediction = predict(
                fit.accumulation,
                work_of(fit.micro_batch, fit.recompute),
                o.planned,
                rates,
                fit.config.comm.desync_check,
                fit.config.precision.dtype,
                pp=fit.layout.pp,
                tp=fit.layout.tp,
                schedule=fit.layout.schedule,
            )
        fitting.sort(key=lambda o: o.prediction.total_s if o.prediction else 0.0)
    t = lap("predict", t)

    chosen = _to_measure(fitting, settings, left(), timed=settings.script is None)
    bench: dict[str, Any] | None = None
    launched = [o.name for o in chosen]
    if chosen and settings.script is not None:
        launched = measure_script(chosen, settings, wall_deadline, say)
    elif chosen:
        say("measuring", 0, len(chosen))
        bench = bench_measure(chosen, settings, runner, on_bench, wall_deadline)
    lap("measure", t)

    winner, reason, eligible = _choose(outcomes, settings.budget)
    if winner is not None:
        w = next(o for o in outcomes if o.name == winner)
        assert w.measured is not None
        for o in outcomes:
            if o.measured is not None and o.measured["paired"] and w.measured["paired"]:
                o.measured["vs_winner_paired"] = paired_ratio(
                    o.measured["step_times_s"], w.measured["step_times_s"]
                )
    verification = None
    if settings.top is None and fitting and settings.script is None:
        # --top all: [Note: verifying the choice], by rounds that only a bench run pairs
        verification = verify(
            fitting, eligible, DEFAULT_TOP, settings.noise_band, {o.name: o.reason for o in fitting}
        )
    phases["total"] = clock() - t0
    return TuneResult(
        settings=settings,
        model_info=info,
        rates=rates,
        outcomes=outcomes,
        winner=winner,
        reason=reason,
        launched=launched,
        phases_s=phases,
        bench=bench,
        verification=verification,
        notes=notes,
    )


def _to_measure(
    fitting: list[Outcome], settings: TuneSettings, budget_s: float, timed: bool
) -> list[Outcome]:
    """The first ``--top`` of ``fitting`` (in order) whose estimated measuring time fits
    ``budget_s``; ``timed`` False: the measuring checks the time itself, launch by launch."""
    chosen: list[Outcome] = []
    spent = LAUNCH_S  # the timing launch itself
    for i, o in enumerate(fitting):
        o.rank = i
        if settings.top is not None and len(chosen) >= settings.top:
            by = "the cost model" if o.prediction is not None else "planning order"
            o.reason = f"ranked {i + 1} by {by}; --top {settings.top}"
            continue
        if timed and o.prediction is not None:
            cost = measuring_cost_s(o.prediction.total_s, settings.warmup, settings.steps)
            if spent + cost > budget_s:
                o.reason = (
                    f"time: about {cost:.0f} s to measure, {max(budget_s - spent, 0):.0f} s of "
                    "--time left"
                )
                continue
            spent += cost
        chosen.append(o)
    return chosen


def _invalid(x: Invalid) -> Outcome:
    return Outcome(x.name, "invalid", x.reason, None, x.mapping)


def _choose(outcomes: list[Outcome], budget: int | None) -> tuple[str | None, str, set[str]]:
    """The fastest measured candidate whose measured live-tensor peak is within the budget;
    a measured candidate over it (the plan was wrong) is marked and passed over. Also the
    names of the measured candidates that may be chosen."""
    eligible = []
    for o in outcomes:
        if o.measured is None:
            continue
        live = o.measured["live_peak_bytes_per_rank"]
        if budget is not None and live and max(live) > budget:
            o.reason = f"measured live-tensor peak {_mib(max(live))} exceeds the budget"
            continue
        eligible.append(o)
    if eligible:
        best = min(eligible, key=lambda o: o.measured["step_time_median_s"])  # type: ignore[index]
        return (
            best.name,
            f"the lowest measured median step of {len(eligible)} measured candidate(s) that fit",
            {o.name for o in eligible},
        )
    if any(o.status == "failed" for o in outcomes):
        return None, "no candidate was measured: the runs failed (see why above)", set()
    if any(
        o.prediction is not None or (o.candidate is not None and o.status == "not measured")
        for o in outcomes
    ):
        return None, "no candidate was measured in the --time given", set()
    if any(o.status == "dropped" for o in outcomes):
        return None, "no candidate fits the --budget", set()
    return None, "no valid candidate", set()
