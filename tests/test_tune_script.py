"""``longboat tune SCRIPT``: a user's own script run under each candidate (the config override
set over its own config, the engine's step budget ending it and reporting its step times),
planned when the script's model is named and measured only when not, all within ``--time``.
No time is asserted beyond the tool keeping to its own ``--time`` flag, with a wide margin."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from longboat.config import ConfigError, load_config
from longboat.config.override import OVERRIDE_VAR, overridden
from longboat.observe.step_budget import MAX_STEPS_VAR, REPORT_DIR_VAR, StepBudget

SCRIPT = Path(__file__).parent / "launch_scripts" / "tune_train.py"


def test_the_override_sets_its_keys_over_the_scripts_config(tmp_path: Path) -> None:
    own = load_config({"strategy": "zero", "zero": {"stage": 3, "bucket_mb": 5.0}, "seed": 7})
    over = tmp_path / "candidate.toml"
    over.write_text('strategy = "zero"\n[zero]\nstage = 1\n[mesh]\npp = 1\n')
    cfg = overridden(own, {OVERRIDE_VAR: str(over)})
    assert (cfg.zero.stage, cfg.zero.bucket_mb, cfg.seed) == (1, 5.0, 7)  # the rest stays
    assert overridden(own, {}) == own
    with pytest.raises(ConfigError, match=OVERRIDE_VAR + ".*does not exist"):
        overridden(own, {OVERRIDE_VAR: str(tmp_path / "none.toml")})
    over.write_text("[zero]\nstage = 9\n")
    with pytest.raises(ConfigError, match=r"(?s)set over the script's config.*'zero.stage'"):
        overridden(own, {OVERRIDE_VAR: str(over)})


def test_the_step_budget_reports_and_ends_the_process_at_its_step(tmp_path: Path) -> None:
    env = {MAX_STEPS_VAR: "3", REPORT_DIR_VAR: str(tmp_path)}
    budget = StepBudget.from_env(1, env)
    assert budget is not None and StepBudget.from_env(0, {}) is None
    budget.step_end(2.0)
    budget.step_end(None)
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit) as stop:
        budget.step_end(1.0)
    assert stop.value.code == 0
    report = json.loads((tmp_path / "rank1.json").read_text())
    assert report["losses"] == [2.0, None, 1.0] and len(report["step_times_s"]) == 3
    assert report["peak_rss_bytes"] > 0
    with pytest.raises(ValueError, match=MAX_STEPS_VAR + "='many'"):
        StepBudget.from_env(0, {MAX_STEPS_VAR: "many"})


def test_a_planned_script_measures_its_best_planned_within_its_time(tmp_path: Path) -> None:
    # One real launch of the script, the cost model's first (a launch takes 20-30 s on this
    # shared machine); the machine's rates are given, as measuring them is the bench's test.
    from test_tune import RATES

    from longboat.tune import output
    from longboat.tune.search import TuneSettings, search

    settings = TuneSettings(
        world_size=2,
        global_batch=16,
        micro_sizes=(4,),
        buckets_mb=(25.0,),
        pp=(1,),
        tp=(1,),
        warmup=1,
        steps=2,
        top=1,
        time_s=180,
        script=str(SCRIPT),
        plan_model="tune_train:build_model",
    )
    t0 = time.monotonic()
    result = search(settings, rates=RATES)
    took = time.monotonic() - t0
    assert not result.notes
    planned = [o for o in result.outcomes if o.status != "invalid"]
    assert len(planned) == 4 and all(o.prediction is not None for o in planned)
    (winner,) = result.launched  # --top 1: the cost model's first
    w = result.outcome(winner)
    assert w.rank == 0 and result.winner == winner, w.reason
    assert w.measured is not None and w.measured["measured_steps"] == 2
    assert len(w.measured["peak_rss_bytes_per_rank"]) == 2
    assert all(x > 0 for x in w.measured["step_times_s"])
    toml, _, _ = output.write(w.mapping, tmp_path / "tuned.toml", [])
    assert load_config(toml) == load_config(w.mapping)
    assert took < 180 + 60  # its own --time, with a wide margin


def test_an_unplanned_script_is_measured_in_planning_order_while_time_lasts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without --plan-model nothing is planned or dropped: the candidates are launched in
    # planning order (the real launch is the test above's; here each is recorded instead).
    from longboat.tune import script
    from longboat.tune.layout import Layout
    from longboat.tune.planning import promising_first
    from longboat.tune.search import TuneSettings, search
    from longboat.tune.space import build_space

    launches: list[tuple[str, dict]] = []

    def launch(o: Any, config: dict, _s: Any, timeout: float) -> None:
        assert timeout > 0
        launches.append((o.name, config))
        o.status, o.measured = "measured", script._figures([_ranked(0), _ranked(1)], 1)

    monkeypatch.setattr(script, "_launch", launch)
    settings = TuneSettings(
        world_size=2,
        global_batch=16,
        micro_sizes=(2, 4),
        buckets_mb=(25.0,),
        pp=(1, 2),
        tp=(1,),
        top=3,
        time_s=600,
        script=str(SCRIPT),
    )
    result = search(settings)
    assert any("measure-only" in n for n in result.notes)
    assert all(o.planned is None and o.prediction is None for o in result.outcomes)
    layouts = [Layout(), Layout(2, 1, "1f1b"), Layout(2, 1, "zb-h1")]
    space = build_space(2, 16, micro_sizes=(2, 4), buckets_mb=(25.0,), layouts=layouts)
    first = [c.name for c in promising_first(space.candidates, (25.0,))[:3]]
    assert [n for n, _ in launches] == result.launched == first
    # The override states the layout whole, so the script's own mesh cannot survive it.
    for _, config in launches:
        assert set(config["mesh"]) == {"pp", "tp"} and "schedule" in config["pipeline"]
    rest = [o for o in result.outcomes if o.status == "not measured"]
    assert rest and all("by planning order; --top 3" in o.reason for o in rest)
    assert result.winner in first
    # With --time spent, no launch starts, and each says why.
    late = [o for o in result.outcomes if o.name in first]
    for o in late:
        o.status, o.reason, o.measured = "not measured", "", None
    assert script.measure_script(late, settings, time.time(), lambda *_: None) == []
    assert all(o.reason.startswith("time:") for o in late)


def _ranked(rank: int) -> dict[str, Any]:
    """A rank's step report as the step budget writes it."""
    return {"rank": rank, "step_times_s": [0.5, 0.2, 0.3], "losses": [1.0] * 3, "peak_rss_bytes": 1}


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--pp", "two"], ["--pp", "'two'", "1,2,4"]),
        (["--tp", "0"], ["--tp", "'0'"]),
        (["--schedules", "1f1b,fast"], ["--schedules", "'fast'", "zb-h1"]),
        (["--plan-model", "train:build"], ["--plan-model", "give the script"]),
        ([str(SCRIPT), "--model", "tiny-gpt"], ["--model", "drop --model"]),
        (["no_such_script.py"], ["no_such_script.py", "does not exist"]),
        (
            [str(SCRIPT), "--plan-model", "tune_train:nothing"],
            ["--plan-model 'tune_train:nothing'", "no callable"],
        ),
    ],
)
def test_usage_errors_exit_2(flags: list[str], words: list[str]) -> None:
    from typer.testing import CliRunner

    from longboat.cli import app

    res = CliRunner().invoke(app, ["tune", *flags])
    assert res.exit_code == 2, res.output
    for w in words:
        assert w in res.output, (w, res.output)
