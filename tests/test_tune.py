"""``longboat tune``: its search space is what the config accepts, a candidate the planner puts
over the budget is never launched, the cost model ranks as its terms say, the written config
(TOML and DeepSpeed JSON) loads back to the one chosen, usage errors exit 2, and one real search
at 2 ranks on a tiny GPT chooses the fastest measured candidate, which fits. No timing is
asserted: the runs only have to compute what a search must compute."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from longboat.cli import app
from longboat.config import load_config
from longboat.tune import output
from longboat.tune.cost import Planned, Rates, Work, predict
from longboat.tune.search import (
    TuneSettings,
    default_planner,
    default_work,
    search,
)
from longboat.tune.space import build_space

MIB = 2**20
RATES = Rates(
    matmul_flops_per_s=1e10,
    op_s=1e-5,
    adamw_elements_per_s=1e8,
    link_bytes_per_s=1e9,
    latency_s=1e-4,
)
#: One stage, no tensor parallelism: the tests of the other dimensions keep their spaces small.
TINY: dict[str, Any] = {"model": "tiny-gpt", "seq_len": 16, "pp": (1,), "tp": (1,)}


class FakeRunner:
    """Stands in for the bench: records every launch and answers with made-up step times
    (``times`` by candidate name, else 1 s)."""

    def __init__(self, times: dict[str, float] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.times = times or {}

    def __call__(self, settings: Any, _progress: Any) -> dict[str, Any]:
        names = list(settings.configs)
        self.calls.append(names)
        rows = []
        for side in names:
            t = self.times.get(side.removeprefix("config:"), 1.0)
            rows.append(
                {
                    "side": side,
                    "step_time_median_s": t,
                    "step_time_iqr_s": 0.0,
                    "step_times_s": [t, t, t],
                    "measured_steps": 3,
                    "losses": [1.0] * 4,
                    "live_peak_bytes_per_rank": None,
                    "peak_rss_bytes_per_rank": None,
                    "rss_after_import_bytes_per_rank": None,
                }
            )
        return {"rows": rows}

    @property
    def launched(self) -> list[str]:
        return [x.removeprefix("config:") for call in self.calls for x in call]


PEAKS = {"replicate": 500, "zero-1": 300, "zero-2": 250, "zero-3": 200, "zero-3+offload": 150}


def _fake_planner(c: Any) -> Planned:
    """Peaks by strategy (recompute saves 10 MiB); ZeRO sends 1.5x replicate's bytes."""
    comm = 100 * MIB if c.strategy == "replicate" else 150 * MIB
    return Planned(
        peak=(PEAKS[c.strategy] - (10 if c.recompute else 0)) * MIB,
        model_state={"optimizer_state": 80 * MIB},
        activations=0,
        comm_bytes={"all_reduce": comm},
        comm_calls={"all_reduce": 4},
    )


def _fake_work(micro: int, recompute: tuple[str, ...]) -> Work:
    # Flops follow the samples (so a step's compute is the same at any micro-batch), operators
    # are per micro-batch, and recompute runs the forward again.
    return Work(flops=int(1e9 * micro * (4 / 3 if recompute else 1)), ops=2000)


def test_space_is_what_the_config_accepts_with_its_reasons() -> None:
    space = build_space(
        2,
        12,
        micro_sizes=(1, 2, 4, 6),
        buckets_mb=(25.0,),
        recompute_classes=("_Block",),
        comm_dtypes=("fp32", "fp8"),
    )
    # Micro-batch 4 does not divide a rank's 6 samples: resolve_batch's own words.
    bad_batch = [x for x in space.invalid if " m4" in x.name and "fp8" not in x.name]
    assert len(bad_batch) == 4 * 2  # every strategy, with and without recompute
    assert all("not divisible by micro_batch_size=4" in x.reason for x in bad_batch)
    # fp8 is not a communication dtype: the config section's validator says so.
    bad_dtype = [x for x in space.invalid if "fp8" in x.name]
    assert len(bad_dtype) == 4 * 4 * 2
    assert all("precision.communication_data_type" in x.reason for x in bad_dtype)
    assert len(space.invalid) == len(bad_batch) + len(bad_dtype)
    # The rest: every strategy x micro 1, 2, 6 x recompute, accumulation = 12 / (micro x 2).
    assert len(space.candidates) == 4 * 3 * 2
    for c in space.candidates:
        assert c.config == load_config(c.mapping)
        assert c.accumulation * c.micro_batch * 2 == 12
        assert c.mapping["batch"]["gradient_accumulation_steps"] == c.accumulation
        assert (c.bucket_mb is None) == (c.strategy == "zero-3")
        assert c.config.activation_checkpointing.classes == list(c.recompute)
    assert {c.strategy for c in space.candidates} == {"replicate", "zero-1", "zero-2", "zero-3"}
    assert len({c.name for c in space.candidates}) == len(space.candidates)
    # One rank: only `single`, nothing communicated, so no dtype to choose.
    one = build_space(1, 4, buckets_mb=(25.0,), comm_dtypes=("fp32", "bf16"))
    assert {c.strategy for c in one.candidates} == {"single"}
    assert [c.micro_batch for c in one.candidates] == [1, 2, 4]


def test_over_budget_is_never_launched_and_refusals_are_invalid() -> None:
    def planner(c: Any) -> Planned:
        if c.strategy == "zero-3" and c.micro_batch == 1:
            from longboat.config import ConfigError

            raise ConfigError("zero-3 refused this at setup")
        return _fake_planner(c)

    runner = FakeRunner({"zero-2 m4x1 b25": 0.5})
    settings = TuneSettings(
        **TINY, world_size=2, global_batch=8, budget=400 * MIB, top=100, buckets_mb=(25.0,)
    )
    result = search(settings, planner=planner, work_of=_fake_work, rates=RATES, runner=runner)
    assert len(runner.calls) == 1  # one bench run, every candidate in it side by side
    over = [o for o in result.outcomes if o.status == "dropped"]
    assert over and all(o.name.startswith("replicate") for o in over)
    assert {o.name for o in over} == {
        o.name for o in result.outcomes if o.name.startswith("replicate")
    }
    assert all(o.reason in ("over budget by 100.0 MiB", "over budget by 90.0 MiB") for o in over)
    assert not any(name.startswith("replicate") for name in runner.launched)
    refused = [o for o in result.outcomes if o.status == "invalid"]
    assert [o.name for o in refused] == ["zero-3 m1x4", "zero-3 m1x4 rc"]
    assert all(o.reason == "zero-3 refused this at setup" for o in refused)
    assert not set(runner.launched) & {o.name for o in refused}
    # Everything else fits and --top 100 takes it all: the budget is the only reason left out.
    fits = {o.name for o in result.outcomes if o.status == "measured"}
    assert fits == set(runner.launched) == set(result.launched)
    assert result.winner == "zero-2 m4x1 b25"  # the fastest measured

    # A budget nothing fits: no launch at all, not even the one that measures the link.
    runner = FakeRunner()
    tight = TuneSettings(**TINY, world_size=2, global_batch=8, budget=100 * MIB)
    result = search(tight, planner=_fake_planner, work_of=_fake_work, runner=runner)
    assert runner.calls == [] and result.winner is None and result.rates is None
    assert result.reason == "no candidate fits the --budget"


def test_the_real_planner_drops_replicate_before_any_launch() -> None:
    # The planner itself (fake tensors) on the tiny GPT; a budget a byte under replicate's
    # smallest planned peak.
    from longboat.bench.models import resolve_model

    settings = TuneSettings(
        **TINY, world_size=2, global_batch=8, micro_sizes=(1, 4), buckets_mb=(25.0,), top=100
    )
    spec = resolve_model("tiny-gpt", 16)
    planner = default_planner(spec, 2)
    space = build_space(2, 8, micro_sizes=(1, 4), buckets_mb=(25.0,), recompute_classes=("_Block",))
    replicate = [c for c in space.candidates if c.strategy == "replicate"]
    budget = min(planner(c).peak for c in replicate) - 1
    runner = FakeRunner()
    result = search(
        dataclasses.replace(settings, budget=budget),
        planner=planner,
        work_of=default_work(spec),
        rates=RATES,
        runner=runner,
    )
    assert len(runner.calls) == 1 and runner.launched
    assert not any(x.startswith("replicate") for x in runner.launched)
    for o in result.outcomes:
        assert o.planned is not None
        assert (o.status == "dropped") == (o.planned.peak > budget)
        if o.name in runner.launched:
            assert o.planned.peak <= budget


def _rank_order(settings: TuneSettings) -> list[str]:
    """The fitting candidates in the cost model's order (fake planner, work and rates)."""
    result = search(
        dataclasses.replace(settings, top=1),
        planner=_fake_planner,
        work_of=_fake_work,
        rates=RATES,
        runner=FakeRunner(),
    )
    ranked = sorted((o for o in result.outcomes if o.rank is not None), key=lambda o: o.rank)
    return [o.name for o in ranked]


def test_top_all_measures_every_fitting_candidate_and_chooses_the_measured_minimum() -> None:
    settings = TuneSettings(
        **TINY, world_size=2, global_batch=8, budget=400 * MIB, top=None, buckets_mb=(25.0,)
    )
    order = _rank_order(settings)
    assert len(order) == 3 * 3 * 2  # zero-1, 2, 3 x micro 1, 2, 4 x recompute; replicate over
    # The cost model's 6th is measured fastest (by 20%); its 2nd is the best of its first 3.
    times = {name: 1.0 for name in order}
    times[order[1]], times[order[5]] = 0.9, 0.72
    runner = FakeRunner(times)
    result = search(settings, planner=_fake_planner, work_of=_fake_work, rates=RATES, runner=runner)
    assert len(runner.calls) == 1  # one bench run: every candidate side by side
    assert sorted(runner.launched) == sorted(order) == sorted(result.launched)
    assert not any(x.startswith("replicate") for x in runner.launched)  # over the budget
    assert all(o.status == "dropped" for o in result.outcomes if o.name.startswith("replicate"))
    assert result.winner == order[5]  # the measured minimum, whatever the prediction
    v = result.verification
    assert v is not None and v.all_measured and v.left_out == []
    assert (v.choice, v.fastest, v.top) == (order[1], order[5], 3)
    assert not v.choice_is_fastest and v.faster == [order[5]]
    assert v.rows[0]["candidate"] == order[5]
    assert v.rows[0]["paired_ratio_to_choice"] == pytest.approx(0.8)
    assert "not the fastest" in v.verdict and order[5] in v.verdict
    # The default --top 3 would have measured the first 3 and chosen the same as the check says.
    top3 = search(
        dataclasses.replace(settings, top=3),
        planner=_fake_planner,
        work_of=_fake_work,
        rates=RATES,
        runner=FakeRunner(times),
    )
    assert top3.winner == v.choice and top3.verification is None

    # 4% faster than the choice is within the 5% band: the choice stands as the fastest.
    times[order[5]] = 0.9 * 0.96
    result = search(
        settings, planner=_fake_planner, work_of=_fake_work, rates=RATES, runner=FakeRunner(times)
    )
    v = result.verification
    assert v is not None and result.winner == order[5] and v.choice == order[1]
    assert v.choice_is_fastest and v.faster == [] and v.within_noise == [order[5]]
    # ... and outside a band of 3%.
    narrow = dataclasses.replace(settings, noise_band=0.03)
    result = search(
        narrow, planner=_fake_planner, work_of=_fake_work, rates=RATES, runner=FakeRunner(times)
    )
    assert result.verification is not None and result.verification.faster == [order[5]]


def test_top_all_verdict_is_by_paired_rounds_and_leaves_out_what_measured_over_budget() -> None:
    settings = TuneSettings(
        **TINY, world_size=2, global_batch=8, budget=400 * MIB, top=None, buckets_mb=(25.0,)
    )
    order = _rank_order(settings)
    choice, rival, big = order[0], order[4], order[7]

    class Runner(FakeRunner):
        def __call__(self, s: Any, progress: Any) -> dict[str, Any]:
            out = super().__call__(s, progress)
            for row in out["rows"]:
                name = row["side"].removeprefix("config:")
                if name == choice:  # a slow machine in round 2 for everyone
                    row["step_times_s"] = [1.0, 3.0, 1.0]
                elif name == rival:  # 10% faster in every round, slower by the median
                    row["step_times_s"] = [0.9, 2.7, 0.9]
                    row["step_time_median_s"] = 1.05  # e.g. a third round on a busier moment
                else:
                    row["step_times_s"] = [1.0, 3.0, 1.0]
                if name == big:  # the plan was wrong: measured over the budget
                    row["step_time_median_s"] = 0.1
                    row["live_peak_bytes_per_rank"] = [401 * MIB, 10]
            return out

    result = search(
        settings, planner=_fake_planner, work_of=_fake_work, rates=RATES, runner=Runner()
    )
    v = result.verification
    assert v is not None and result.winner != big
    assert v.faster == [rival]  # paired: 0.9 of the choice in each round
    assert not v.all_measured and len(v.left_out) == 1 and v.left_out[0].startswith(big)
    assert "exceeds the budget" in v.left_out[0]
    assert big not in {r["candidate"] for r in v.rows}


def test_cost_model_terms_and_ranking() -> None:
    planned = Planned(
        peak=0,
        model_state={"optimizer_state": 8_000_000},
        activations=0,
        comm_bytes={"reduce_scatter": 2_000_000, "all_gather": 1_000_000},
        comm_calls={"reduce_scatter": 6, "all_gather": 4},
    )
    p = predict(3, Work(flops=4_000_000_000, ops=1000), planned, RATES, desync_check=True)
    assert p.compute_s == pytest.approx(3 * 4e9 / 1e10)
    assert p.overhead_s == pytest.approx(3 * 1000 * 1e-5)
    assert p.optimizer_s == pytest.approx(1_000_000 / 1e8)  # 8 bytes of AdamW state each
    assert p.comm_s == pytest.approx(3e6 / 1e9 + 10 * 1e-4 * 2)  # fingerprints double calls
    assert predict(3, Work(4_000_000_000, 1000), planned, RATES, False).comm_s == pytest.approx(
        3e6 / 1e9 + 10 * 1e-4
    )
    assert p.total_s == pytest.approx(
        p.compute_s + p.overhead_s + p.optimizer_s + p.comm_s + p.disk_s
    )

    # In a search: the order is the predicted totals', and it says what the terms say.
    settings = TuneSettings(**TINY, world_size=2, global_batch=8, buckets_mb=(25.0,), top=1)
    result = search(
        settings, planner=_fake_planner, work_of=_fake_work, rates=RATES, runner=FakeRunner()
    )
    ranked = sorted((o for o in result.outcomes if o.rank is not None), key=lambda o: o.rank)
    totals = [o.prediction.total_s for o in ranked]
    assert totals == sorted(totals) and len(ranked) == 4 * 3 * 2
    order = [o.name for o in ranked]
    # Fewer micro-batches per step pay less overhead; less traffic is faster; recompute costs.
    assert order.index("replicate m4x1 b25") < order.index("replicate m2x2 b25")
    assert order.index("replicate m2x2 b25") < order.index("replicate m1x4 b25")
    assert order.index("replicate m4x1 b25") < order.index("zero-2 m4x1 b25")
    assert order.index("zero-2 m4x1 b25") < order.index("zero-2 m4x1 b25 rc")
    assert order[0] == "replicate m4x1 b25" == result.launched[0]
    assert ranked[1].reason == "ranked 2 by the cost model; --top 1"


def test_what_does_not_fit_in_the_time_is_not_measured() -> None:
    runner = FakeRunner()
    settings = TuneSettings(**TINY, world_size=2, global_batch=8, time_s=1.0)
    result = search(settings, planner=_fake_planner, work_of=_fake_work, rates=RATES, runner=runner)
    assert runner.calls == [] and result.winner is None
    best = next(o for o in result.outcomes if o.rank == 0)
    assert best.status == "not measured" and best.reason.startswith("time: about")
    assert result.reason == "no candidate was measured in the --time given"


def test_planning_keeps_to_its_share_of_the_time_and_the_best_planned_is_measured() -> None:
    """A planner that takes 1 s per candidate (a fake clock: nothing sleeps) in a 40 s search:
    planning stops at half the time, having gone round every strategy plainest-first; what
    was not planned says so; the best of what was planned is measured."""
    clock = [0.0]

    def slow_planner(c: Any) -> Planned:
        clock[0] += 1.0
        return _fake_planner(c)

    runner = FakeRunner()
    settings = TuneSettings(**TINY, world_size=2, global_batch=8, time_s=40.0, warmup=0, steps=1)
    result = search(
        settings,
        planner=slow_planner,
        work_of=_fake_work,
        rates=RATES,
        runner=runner,
        clock=lambda: clock[0],
    )
    planned = [o for o in result.outcomes if o.planned is not None]
    unplanned = [o for o in result.outcomes if o.reason.startswith("time: not planned")]
    assert len(planned) == 21 and unplanned, [o.name for o in planned]  # at t = 0..20
    strategies = {o.candidate.strategy for o in result.outcomes if o.candidate}
    first_round = [o.candidate for o in planned[: len(strategies)] if o.candidate]
    assert {c.strategy for c in first_round} == strategies, "round the strategies first"
    biggest = max(c.micro_batch for c in first_round)
    assert all(not c.recompute and c.micro_batch == biggest for c in first_round)
    assert all(o.status == "not measured" for o in unplanned)
    assert runner.launched and result.winner in runner.launched


def test_offloading_candidates_measure_in_directories_of_their_own(tmp_path: Path) -> None:
    seen: dict[str, bool] = {}

    class Runner(FakeRunner):
        def __call__(self, settings: Any, progress: Any) -> dict[str, Any]:
            for name, cfg in settings.configs.items():
                if "offload_optimizer" in cfg.get("zero", {}):
                    where = Path(cfg["zero"]["offload_optimizer"]["path"])
                    assert where.parent == tmp_path and where.is_dir()
                    seen[name] = True
            return super().__call__(settings, progress)

    settings = TuneSettings(
        **TINY, world_size=2, global_batch=8, top=100, time_s=1e6, offload_dir=str(tmp_path)
    )
    result = search(
        settings, planner=_fake_planner, work_of=_fake_work, rates=RATES, runner=Runner()
    )
    offloaded = [o for o in result.outcomes if o.name.startswith("zero-3+offload")]
    assert offloaded and {f"config:{o.name}" for o in offloaded} == set(seen)
    for o in offloaded:  # the written config names the directory given, not the scratch one
        assert o.mapping["zero"]["offload_param"]["path"] == str(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the measuring runs' directories are gone


CHOSEN = [
    # (strategy, micro, bucket, recompute, comm, offload): DeepSpeed JSON expected?
    (("replicate", 4, 25.0, (), "fp32", None), True),
    (("replicate", 4, 5.0, (), "fp32", None), False),  # a replicate bucket DeepSpeed cannot say
    (("zero-2", 2, 5.0, (), "bf16", None), True),
    (("zero-1", 1, 25.0, ("_Block",), "fp32", None), False),  # recompute by class
    (("zero-3", 2, None, (), "fp32", None), True),
    (("zero-3+offload", 2, None, (), "fp32", "/tmp/offload here"), True),
]


@pytest.mark.parametrize(("what", "expressible"), CHOSEN)
def test_written_config_and_deepspeed_json_load_to_the_chosen(
    tmp_path: Path, what: tuple[Any, ...], expressible: bool
) -> None:
    strategy, micro, bucket, rc, comm, offload = what
    space = build_space(
        2,
        16,
        micro_sizes=(micro,),
        buckets_mb=(bucket or 25.0,),
        recompute_classes=rc,
        comm_dtypes=(comm,),
        offload_dir=offload,
    )
    (c,) = [
        x
        for x in space.candidates
        if x.strategy == strategy and x.recompute == rc and x.bucket_mb == bucket
    ]
    out = tmp_path / "tuned.toml"
    stale = output.deepspeed_path(out)
    stale.write_text("{}")  # an earlier run's file must not outlive a config it cannot say
    toml, ds, why = output.write(c.mapping, out, ["chosen: " + c.name, "measured: 1.0 s"])
    text = toml.read_text()
    assert text.startswith(f"# chosen: {c.name}\n# measured: 1.0 s\n")
    assert load_config(toml) == c.config
    assert load_config(toml).batch.gradient_accumulation_steps == 16 // (2 * micro)
    if expressible:
        assert ds == stale and why is None
        data = json.loads(ds.read_text())
        assert data["train_micro_batch_size_per_gpu"] == micro
        assert data["gradient_accumulation_steps"] == 16 // (2 * micro)
        stage = 0 if strategy == "replicate" else int(strategy[5])
        assert data["zero_optimization"]["stage"] == stage
        assert load_config(ds) == c.config  # through longboat's own DeepSpeed reader
    else:
        assert ds is None and not stale.exists()
        assert ("activation_checkpointing" if rc else "replicate.bucket_mb") in why


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--budget", "lots"], ["--budget", "'lots'", "512MiB"]),
        (["--budget", "0"], ["--budget", "'0'", "not positive"]),
        (["--world-size", "0"], ["--world-size 0", "1 or more"]),
        (["--model", "no-such-model"], ["--model", "'no-such-model'", "reference-gpt"]),
        (["--model", "no_such_pkg:spec"], ["--model", "no_such_pkg"]),
        (["--global-batch", "7"], ["--global-batch 7", "--world-size 2", "multiple of 2"]),
        (["--time", "soon"], ["--time", "'soon'", "10m"]),
        (["--top", "0"], ["--top 0", "1 or more"]),
        (["--top", "most"], ["--top most", "or all"]),
        (["--noise-band", "1.5"], ["--noise-band 1.5", "0.05"]),
        (["--comm-dtypes", "fp32,fp8"], ["--comm-dtypes", "'fp8'", "bf16"]),
        (["--precisions", "fp32,fp16"], ["--precisions", "'fp16'", "bf16-params", "auto"]),
        (["--micro-batches", "two"], ["--micro-batches", "'two'", "1,2,4"]),
        (["--bucket-mb", "-1"], ["--bucket-mb", "'-1'", "25,5"]),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, flags: list[str], words: list[str]) -> None:
    out = tmp_path / "tuned.toml"
    res = CliRunner().invoke(
        app, ["tune", "--model", "tiny-gpt", "--seq-len", "16", "--out", str(out), *flags]
    )
    assert res.exit_code == 2, res.output
    for w in words:
        assert w in res.output, (w, res.output)
    assert not out.exists()


def test_a_real_search_at_two_ranks_measures_all_that_fits_and_chooses_the_fastest(
    tmp_path: Path,
) -> None:
    # --top all on the tiny GPT: every candidate the planner lets through is measured side by
    # side, and the choice is the lowest measured median. Which configuration is faster is
    # the machine's business: nothing here asserts a time or an order between them.
    spec_args = ["--model", "tiny-gpt", "--seq-len", "16", "--world-size", "2"]
    space = ["--global-batch", "8", "--micro-batches", "2,4", "--bucket-mb", "25"]
    space += ["--pp", "1", "--tp", "1"]
    from longboat.bench.models import resolve_model

    planner = default_planner(resolve_model("tiny-gpt", 16), 2)
    replicate = [
        c
        for c in build_space(2, 8, micro_sizes=(2, 4), buckets_mb=(25.0,)).candidates
        if c.strategy == "replicate"
    ]
    budget = min(planner(c).peak for c in replicate) - 1  # no replicate candidate fits
    out = tmp_path / "tuned.toml"
    res = CliRunner().invoke(
        app,
        [
            "tune",
            *spec_args,
            *space,
            "--no-recompute",
            "--budget",
            str(budget),
            "--top",
            "all",
            "--steps",
            "3",
            "--time",
            "5m",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    rows = {c["name"]: c for c in report["candidates"]}
    assert len(rows) == 8  # 4 strategies x micro-batches 2 and 4
    assert all(r["status"] == "dropped" for n, r in rows.items() if n.startswith("replicate"))
    assert report["launched"] and not any(x.startswith("replicate") for x in report["launched"])
    measured = {n: r for n, r in rows.items() if r["measured"] is not None}
    fitting = {n for n, r in rows.items() if r["rank_by_cost_model"] is not None}
    assert len(fitting) == 6  # ZeRO-1, 2 and 3 at micro-batches 2 and 4
    assert set(measured) == set(report["launched"]) == fitting  # --time 5m was enough
    winner = rows[report["winner"]]
    assert winner["status"] == "winner"
    medians = {n: r["measured"]["step_time_median_s"] for n, r in measured.items()}
    assert medians[report["winner"]] == min(medians.values())
    # The check of the default's choice: the best measured of the cost model's first 3, set
    # against every other by paired rounds.
    v = report["verification"]
    assert v["all_measured"] and v["fastest"] == report["winner"]
    first3 = [n for n in measured if rows[n]["rank_by_cost_model"] < 3]
    assert v["choice"] == min(first3, key=medians.get)
    assert {r["candidate"] for r in v["rows"]} == fitting
    for r in v["rows"]:
        times = measured[r["candidate"]]["measured"]["step_times_s"]
        base = measured[v["choice"]]["measured"]["step_times_s"]
        assert r["paired_ratio_to_choice"] == pytest.approx(
            sorted(a / b for a, b in zip(times, base, strict=True))[1]  # 3 rounds: the middle
        )
    assert v["choice_is_fastest"] == (not v["faster"])
    assert v["faster"] == [
        r["candidate"] for r in v["rows"] if r["paired_ratio_to_choice"] < 1 - v["band"]
    ]
    for r in measured.values():
        live = r["measured"]["live_peak_bytes_per_rank"]
        assert len(live) == 2 and max(live) <= budget  # planned to fit, and measured to
        assert r["predicted"]["peak"] <= budget
        assert r["measured"]["measured_steps"] == 3
    # Every measured candidate trained the same run (same samples, same initial weights).
    losses = [r["measured"]["losses"] for r in measured.values()]
    assert all(x == pytest.approx(losses[0], abs=1e-5) for x in losses)
    assert load_config(out) == load_config(winner["config"])
    assert "Chosen: " + report["winner"] in out.read_text()
    ds = report["outputs"]["deepspeed"]
    if not ds.startswith("not written"):
        assert load_config(ds) == load_config(out)


def test_precisions_are_searched_where_the_config_takes_them() -> None:
    """bf16 autocast is a candidate under every strategy; bf16 parameters under the ZeRO stages,
    and replicate's is recorded with the composition table's own refusal."""
    space = build_space(
        2, 8, micro_sizes=(4,), buckets_mb=(25.0,), precisions=("fp32", "bf16", "bf16-params")
    )
    by = {(c.strategy, c.precision): c for c in space.candidates}
    for s in ("replicate", "zero-1", "zero-2", "zero-3"):
        assert by[(s, "fp32")].config.precision.dtype == "fp32"
        assert by[(s, "bf16")].config.precision.dtype == "bf16"
        assert by[(s, "bf16")].config.precision.param_dtype in (None, "fp32")
    for s in ("zero-1", "zero-2", "zero-3"):
        low = by[(s, "bf16-params")]
        assert (low.config.precision.dtype, low.config.precision.param_dtype) == ("bf16", "bf16")
        assert low.config.zero.stage == int(s[-1])
    assert by[("zero-3", "bf16-params")].name == "zero-3 m4x1 bf16-params"
    assert {s for s, p in by if p == "bf16-params"} == {"zero-1", "zero-2", "zero-3"}
    refused = [x for x in space.invalid if x.name.endswith("bf16-params")]
    assert sorted(x.name.split()[0] for x in refused) == ["replicate"]
    assert all("param_dtype" in x.reason for x in refused), [x.reason for x in refused]
    assert len({c.name for c in space.candidates}) == len(space.candidates)


def test_a_bf16_candidate_is_predicted_at_the_bf16_rate() -> None:
    work = Work(flops=int(4e9), ops=0)
    planned = Planned(peak=0, model_state={}, activations=0, comm_bytes={}, comm_calls={})
    rates = dataclasses.replace(RATES, bf16_matmul_flops_per_s=4e10)
    assert predict(1, work, planned, rates).compute_s == pytest.approx(0.4)
    assert predict(1, work, planned, rates, compute_dtype="bf16").compute_s == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no bf16 rate was measured"):
        predict(1, work, planned, RATES, compute_dtype="bf16")


def test_the_planner_plans_bf16_parameters() -> None:
    """The real planner on bf16-parameter ZeRO candidates: at every stage a step's
    reduce-scatters and all-gathers move exactly half the bytes of the bf16-autocast one's (the
    masters that ``close()`` gathers after training are no step's traffic)."""
    from longboat.bench.models import resolve_model

    space = build_space(
        2, 8, micro_sizes=(4,), buckets_mb=(25.0,), precisions=("bf16", "bf16-params")
    )
    plan = default_planner(resolve_model("tiny-gpt", 16), 2)
    for stage in ("zero-1", "zero-2", "zero-3"):
        moved = {c.precision: plan(c).comm_bytes for c in space.candidates if c.strategy == stage}
        assert moved["bf16"]["reduce_scatter"] > 0 and moved["bf16"]["all_gather"] > 0
        for op in ("reduce_scatter", "all_gather"):
            assert moved["bf16-params"][op] * 2 == moved["bf16"][op], (stage, moved)


def test_bf16_choices_are_written_for_deepspeed_as_its_bf16_means_them(tmp_path: Path) -> None:
    """DeepSpeed's bf16 is bf16 parameters with fp32 masters under ZeRO ([Note: DeepSpeed's
    bf16] in config/deepspeed.py) and bf16 autocast where that is refused (replicate): each
    candidate is written where the JSON loads back to it, and not where it would not."""
    space = build_space(
        2, 8, micro_sizes=(4,), buckets_mb=(25.0,), precisions=("bf16", "bf16-params")
    )
    by = {(c.strategy, c.precision): c for c in space.candidates}
    for key in (("replicate", "bf16"), ("zero-2", "bf16-params")):
        _, ds, why = output.write(by[key].mapping, tmp_path / f"{key[0]}.toml", [])
        assert ds is not None and why is None, key
        assert json.loads(ds.read_text())["bf16"] == {"enabled": True}
        assert load_config(ds) == by[key].config
    _, ds, why = output.write(by[("zero-2", "bf16")].mapping, tmp_path / "amp.toml", [])
    assert ds is None and why is not None and "param_dtype" in why
