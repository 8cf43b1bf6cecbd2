"""The search: plan every candidate, drop what does not fit, rank the rest by the cost model,
measure the best few side by side, and choose the fastest measured one that fits.

[Note: tune phases] In order, each bounded by the ``--time`` budget counted from the start:

1. the search space (``space.py``): every combination the config accepts;
2. the planner on every candidate (``longboat.plan.simulate``, fake tensors, nothing
   allocated): its predicted peak per rank; a candidate over the budget is *dropped* and is
   never launched, whatever else happens; a candidate a strategy refuses at setup is invalid.
   Planning takes at most ``PLAN_SHARE`` of ``--time`` (a second or two per candidate adds up
   over a large space), the rest being for the rates and measuring; it goes round the
   strategies, each one's plainest candidates first (:func:`promising_first`), so that what is
   planned in the time spans the strategies, and what is not is reported so;
3. this machine's rates (``machine.py``, a few seconds), when anything fits;
4. the cost model (``cost.py``) on what fits, fastest first;
5. the first ``--top`` of them whose estimated measuring time still fits the time left are
   measured in one bench run (``longboat.bench.run_bench``: all of them built in one launch
   of ranks, single steps alternating, medians; then each alone for its memory, with the
   live-tensor peak the planner predicts and peak RSS). The bench's deadline is the end of the
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

import itertools
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from longboat.bench.models import ModelSpec, resolve_model
from longboat.bench.runner import MEMORY_STEPS, BenchProgressFn, BenchSettings, run_bench
from longboat.bench.sides import CONFIG_PREFIX
from longboat.config.errors import ConfigError
from longboat.plan.target import PlanInputError
from longboat.tune.cost import Planned, Prediction, Rates, Work, count_work, predict
from longboat.tune.space import DEFAULT_BUCKETS_MB, Candidate, Invalid, build_space
from longboat.tune.target import plan_target
from longboat.tune.verify import DEFAULT_TOP, NOISE_BAND, Verification, paired_ratio, verify

#: measured; dropped (over the budget: never launched); not measured (below the --top, or not
#: in the --time left); invalid (refused by the config or by a strategy at setup)
Status = Literal["measured", "dropped", "not measured", "invalid"]
#: Rough costs of a bench launch and of building a side in it, to decide what can be measured
#: in the time left (the bench's deadline holds the line when they are wrong).
LAUNCH_S = 3.0
BUILD_S = 2.0
TRACKED = 1.5  # a memory launch's steps run under the live-tensor tracker: slower
#: The share of ``--time`` planning may take ([Note: tune phases]).
PLAN_SHARE = 0.5


@dataclass(frozen=True)
class TuneSettings:
    """What a search depends on (recorded in full in its report)."""

    model: str = "reference-gpt"
    world_size: int = 2
    global_batch: int | None = None  # default: 8 per rank, as longboat bench's default
    budget: int | None = None  # bytes per rank, as the planner counts them (live tensors)
    time_s: float = 600.0
    top: int | None = DEFAULT_TOP  # None: every candidate that fits (``--top all``)
    seq_len: int = 128
    warmup: int = 1
    steps: int = 5
    micro_sizes: tuple[int, ...] = ()  # default: powers of two up to a rank's share
    buckets_mb: tuple[float, ...] = DEFAULT_BUCKETS_MB
    recompute: bool = True  # search activation checkpointing of the model's block classes
    comm_dtypes: tuple[str, ...] = ("fp32",)
    precisions: tuple[str, ...] = ("fp32",)  # keys of tune.space.PRECISIONS
    offload_dir: str | None = None  # adds ZeRO-3 with its state on disk, there
    #: with ``top=None``: the paired-ratio margin of [Note: verifying the choice]
    noise_band: float = NOISE_BAND

    @property
    def batch(self) -> int:
        return self.global_batch or 8 * self.world_size


@dataclass
class Outcome:
    """One combination's fate: its plan, prediction and measurement where it got that far."""

    name: str
    status: Status
    reason: str = ""
    candidate: Candidate | None = None
    mapping: dict[str, Any] = field(default_factory=dict)
    planned: Planned | None = None
    prediction: Prediction | None = None
    rank: int | None = None  # place in the cost model's order (0: predicted fastest)
    measured: dict[str, Any] | None = None  # the bench's figures (see _measured)


@dataclass
class TuneResult:
    """Everything a search found; ``winner`` is the chosen outcome's name (None: none)."""

    settings: TuneSettings
    model_info: dict[str, Any]
    rates: Rates | None  # None when nothing fitted, so nothing needed predicting
    outcomes: list[Outcome]
    winner: str | None
    reason: str
    launched: list[str]  # the candidates handed to the bench, in rank order
    phases_s: dict[str, float]
    bench: dict[str, Any] | None = None  # the bench's raw result (settings, rows, order)
    #: with ``--top all``: whether the default's choice is the fastest ([Note: verifying the
    #: choice]); None otherwise
    verification: Verification | None = None

    def outcome(self, name: str) -> Outcome:
        return next(o for o in self.outcomes if o.name == name)


Planner = Callable[[Candidate], Planned]
WorkOf = Callable[[int, tuple[str, ...]], Work]
Runner = Callable[[BenchSettings, BenchProgressFn], dict[str, Any]]
Say = Callable[[str, int, int], None]  # (what, done, total)


def default_planner(spec: ModelSpec, world_size: int) -> Planner:
    """Plans a candidate with ``longboat.plan.simulate``: the engine and the candidate's
    strategy on fake tensors, two optimizer steps of its accumulation."""
    from longboat.plan.planner import OFFLOAD_PATH, OPTIMIZERS
    from longboat.plan.simulate import simulate

    target = plan_target(spec)

    def plan(c: Candidate) -> Planned:
        cfg = c.config
        if cfg.zero.offload_optimizer.device == "disk":  # the fake run writes no file
            zero = cfg.zero.model_copy(
                update={
                    "offload_optimizer": cfg.zero.offload_optimizer.model_copy(
                        update={"path": OFFLOAD_PATH}
                    ),
                    "offload_param": cfg.zero.offload_param.model_copy(
                        update={"path": OFFLOAD_PATH}
                    ),
                }
            )
            cfg = cfg.model_copy(update={"zero": zero})
        cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"progress": False})})
        sim = simulate(target, cfg, world_size, c.micro_batch, OPTIMIZERS["adamw"])
        return Planned(
            peak=sim.peak,
            model_state=sim.model_state,
            activations=sim.activations,
            comm_bytes=sim.comm_bytes,
            comm_calls=sim.comm_calls,
            disk_moved=sim.disk_moved,
        )

    return plan


def default_work(spec: ModelSpec) -> WorkOf:
    """Counts a micro-batch's flops and operators on fake tensors, once per size and recompute."""
    target = plan_target(spec)
    cache: dict[tuple[int, tuple[str, ...]], Work] = {}

    def work(micro: int, recompute: tuple[str, ...]) -> Work:
        key = (micro, recompute)
        if key not in cache:
            cache[key] = count_work(target.build, target.example_input, target.loss, *key)
        return cache[key]

    return work


def default_runner(settings: BenchSettings, on_progress: BenchProgressFn) -> dict[str, Any]:
    """The bench itself."""
    return run_bench(settings, on_progress)


def measuring_cost_s(predicted_s: float, warmup: int, steps: int) -> float:
    """Estimated seconds to measure one candidate: its part of the timing launch and its own
    memory launch."""
    timing = BUILD_S + (warmup + steps) * predicted_s
    memory = LAUNCH_S + BUILD_S + (warmup + MEMORY_STEPS) * predicted_s * TRACKED
    return timing + memory


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _measured(row: dict[str, Any]) -> dict[str, Any]:
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
    }


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
    spec = resolve_model(settings.model, settings.seq_len)
    n = settings.world_size

    def left() -> float:
        return settings.time_s - (clock() - t0)

    def lap(name: str, since: float) -> float:
        now = clock()
        phases[name] = now - since
        return now

    space = build_space(
        n,
        settings.batch,
        micro_sizes=settings.micro_sizes or None,
        buckets_mb=settings.buckets_mb,
        recompute_classes=spec.unit_classes if settings.recompute else (),
        comm_dtypes=settings.comm_dtypes,
        offload_dir=settings.offload_dir,
        precisions=settings.precisions,
    )
    outcomes = [_invalid(x) for x in space.invalid]
    t = lap("space", t0)

    planner = planner or default_planner(spec, n)
    fitting: list[Outcome] = []
    ordered = promising_first(space.candidates, settings.buckets_mb)
    for i, c in enumerate(ordered):
        if clock() - t0 > PLAN_SHARE * settings.time_s:
            why = (
                f"time: not planned; planning had used its share of --time ({i} of {len(ordered)})"
            )
            outcomes.append(Outcome(c.name, "not measured", why, c, c.mapping))
            continue
        say(f"planning {c.name}", i, len(ordered))
        try:
            planned = planner(c)
        except (ConfigError, PlanInputError) as e:  # a strategy refused it at setup
            outcomes.append(Outcome(c.name, "invalid", str(e), c, c.mapping))
            continue
        o = Outcome(c.name, "not measured", "", c, c.mapping, planned)
        if settings.budget is not None and planned.peak > settings.budget:
            o.status = "dropped"  # and never launched: [Note: tune phases]
            o.reason = f"over budget by {_mib(planned.peak - settings.budget)}"
        else:
            fitting.append(o)
        outcomes.append(o)
    t = lap("plan", t)

    if fitting and rates is None:
        from longboat.tune import machine

        say("measuring this machine", 0, 1)
        low = any(o.candidate is not None and o.candidate.precision != "fp32" for o in fitting)
        rates = machine.measure(n, settings.offload_dir, bf16=low)
    t = lap("rates", t)
    work_of = work_of or default_work(spec)
    for o in fitting:
        fit = o.candidate
        assert fit is not None and o.planned is not None and rates is not None
        work = work_of(fit.micro_batch, fit.recompute)
        o.prediction = predict(
            fit.accumulation,
            work,
            o.planned,
            rates,
            fit.config.comm.desync_check,
            fit.config.precision.dtype,
        )
    t = lap("predict", t)

    fitting.sort(key=lambda o: o.prediction.total_s if o.prediction else 0.0)
    chosen: list[Outcome] = []
    budget_s = left()
    spent = LAUNCH_S  # the timing launch itself
    for i, o in enumerate(fitting):
        o.rank = i
        assert o.prediction is not None
        if settings.top is not None and len(chosen) >= settings.top:
            o.reason = f"ranked {i + 1} by the cost model; --top {settings.top}"
            continue
        cost = measuring_cost_s(o.prediction.total_s, settings.warmup, settings.steps)
        if spent + cost > budget_s:
            o.reason = (
                f"time: about {cost:.0f} s to measure, {max(budget_s - spent, 0):.0f} s of "
                "--time left"
            )
            continue
        spent += cost
        chosen.append(o)

    bench: dict[str, Any] | None = None
    launched = [o.name for o in chosen]
    if chosen:
        configs = {}
        for o in chosen:
            assert o.candidate is not None
            configs[CONFIG_PREFIX + o.name] = _for_measuring(o.candidate)
        bench_settings = BenchSettings(
            model=settings.model,
            strategies=(),
            peers=(),
            world_sizes=(n,),
            micro_batch=settings.batch // n,  # a rank's share of the step
            seq_len=settings.seq_len,
            warmup=settings.warmup,
            steps=settings.steps,
            memory=True,
            configs=configs,
            live_peak=True,
            deadline=wall_deadline,
        )
        say("measuring", 0, len(chosen))
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
            o.measured = _measured(row)
    lap("measure", t)

    winner, reason, eligible = _choose(outcomes, settings.budget)
    if winner is not None:
        w = next(o for o in outcomes if o.name == winner)
        assert w.measured is not None
        for o in outcomes:
            if o.measured is not None:
                o.measured["vs_winner_paired"] = paired_ratio(
                    o.measured["step_times_s"], w.measured["step_times_s"]
                )
    verification = None
    if settings.top is None and fitting:  # --top all: [Note: verifying the choice]
        verification = verify(
            fitting, eligible, DEFAULT_TOP, settings.noise_band, {o.name: o.reason for o in fitting}
        )
    phases["total"] = clock() - t0
    return TuneResult(
        settings=settings,
        model_info=dict(spec.info),
        rates=rates,
        outcomes=outcomes,
        winner=winner,
        reason=reason,
        launched=launched,
        phases_s=phases,
        bench=bench,
        verification=verification,
    )


def promising_first(candidates: list[Candidate], buckets_mb: tuple[float, ...]) -> list[Candidate]:
    """``candidates`` in the order to plan them when the time may not cover all: round the
    strategies, each one's plainest first (no recompute, gradients in fp32, the first bucket
    size given, the largest micro-batch: the usual fastest that fits)."""

    def plainness(c: Candidate) -> tuple[bool, bool, int, int]:
        bucket = buckets_mb.index(c.bucket_mb) if c.bucket_mb in buckets_mb else 0
        return (
            bool(c.recompute),
            c.comm_dtype != "fp32" or c.precision != "fp32",
            bucket,
            -c.micro_batch,
        )

    by_strategy: dict[str, list[Candidate]] = {}
    for c in sorted(candidates, key=plainness):
        by_strategy.setdefault(c.strategy, []).append(c)
    rounds = itertools.zip_longest(*by_strategy.values())
    return [c for row in rounds for c in row if c is not None]


def _invalid(x: Invalid) -> Outcome:
    return Outcome(x.name, "invalid", x.reason, None, x.mapping)


def _for_measuring(c: Candidate) -> dict[str, Any]:
    """The candidate's config for the bench: with offload, a directory of its own under the
    offload directory, as two candidates in one process must not share files."""
    import copy
    import tempfile

    data = copy.deepcopy(c.mapping)
    zero = data.get("zero", {})
    if zero.get("offload_optimizer", {}).get("device") == "disk":
        where = tempfile.mkdtemp(prefix="tune-", dir=zero["offload_optimizer"]["path"])
        zero["offload_optimizer"]["path"] = where
        zero["offload_param"]["path"] = where
    return data


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
    if any(o.prediction is not None for o in outcomes):
        return None, "no candidate was measured in the --time given", set()
    if any(o.status == "dropped" for o in outcomes):
        return None, "no candidate fits the --budget", set()
    return None, "no valid candidate", set()
