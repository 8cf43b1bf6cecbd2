"""``longboat tune SCRIPT``'s two mechanisms in the engine: the config override set over a
script's own config, and the step budget that ends a run and reports its step times."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longboat.config import ConfigError, load_config
from longboat.config.override import OVERRIDE_VAR, overridden
from longboat.observe.step_budget import MAX_STEPS_VAR, REPORT_DIR_VAR, StepBudget


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
