"""The table of compositions ([Note: compositions] in longboat/config/compositions/): every rule
refuses its own example through the real entry point (loading the config for what the config
decides, ``longboat.initialize`` on every rank for what the model or the optimizer decides),
and its example is refused by that rule, not by an earlier one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import longboat
from longboat.config import ConfigError, load_config
from longboat.config.compositions import BY_NAME, RULES, Facts, refusal, unchecked
from longboat.optim import Lamb, OneBitAdam

#: Rules the config alone decides: their example is refused on loading.
BY_CONFIG = [r.name for r in RULES if r.example_facts == Facts()]
#: Rules that need what the engine knows of the model, the optimizer or the device.
BY_FACTS = [r.name for r in RULES if r.example_facts != Facts()]


def test_the_table_has_both_kinds_and_unique_names() -> None:
    assert len(BY_NAME) == len(RULES)
    assert BY_CONFIG and BY_FACTS


@pytest.mark.parametrize("name", BY_CONFIG)
def test_loading_refuses_each_rules_example_with_its_reason(name: str) -> None:
    rule = BY_NAME[name]
    with pytest.raises(ConfigError) as e:
        load_config(dict(rule.example))
    assert rule.message(unchecked(rule.example), Facts()) in str(e.value)


@pytest.mark.parametrize("name", BY_CONFIG)
def test_a_config_object_is_refused_too(name: str) -> None:
    """``initialize`` takes a Config as well as a dict: it is checked alike on loading."""
    rule = BY_NAME[name]
    with pytest.raises(ConfigError, match="invalid config"):
        load_config(unchecked(rule.example))


@pytest.mark.parametrize("name", BY_FACTS)
def test_each_rule_with_facts_is_the_first_to_refuse_its_example(name: str) -> None:
    rule = BY_NAME[name]
    config = unchecked(rule.example)
    load_config(config)  # the config alone is accepted ...
    assert refusal(config, rule.example_facts) == rule.message(config, rule.example_facts)


def test_the_defaults_and_each_strategy_alone_are_accepted() -> None:
    for strategy in ("auto", "single", "replicate", "zero", "parameter_server"):
        assert refusal(load_config({"strategy": strategy})) is None


# -- through longboat.initialize, on every rank -------------------------------------------------


def _initialize(case: str, tmp: str) -> str:
    """Build what ``case`` names and initialise it; the ConfigError's text, or 'accepted'."""
    torch.manual_seed(0)
    config: dict[str, Any] = {"batch": {"micro_batch_size": 2}}
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if case == "meta-device":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        config["strategy"] = "replicate"
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if case == "zero-elementwise":
        config["strategy"] = "zero"
        optimizer = Lamb(model.parameters(), lr=1e-3)
    if case == "server-elementwise":
        config["strategy"] = "parameter_server"
        optimizer = Lamb(model.parameters(), lr=1e-3)
    if case == "disk-offload-step-hooks":
        config["strategy"] = "zero"
        config["zero"] = {"stage": 2, "offload_optimizer": {"device": "disk", "path": tmp}}
        optimizer.register_step_pre_hook(lambda *_: None)
    if case == "self-reducing-compression":
        config["strategy"] = "replicate"
        config["compression"] = {"method": "powersgd"}
        optimizer = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)
    try:
        longboat.initialize(model, optimizer, config).close()
    except ConfigError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize(
    ("case", "world", "named"),
    [
        ("meta-device", 1, ["meta device", "'replicate'"]),
        ("zero-elementwise", 2, ["element-wise", "Lamb"]),
        ("server-elementwise", 2, ["update_on_server = true with Lamb"]),
        ("disk-offload-step-hooks", 1, ["step hooks"]),
        ("self-reducing-compression", 1, ["OneBitAdam", "compressed twice"]),
    ],
)
def test_the_engine_refuses_what_the_model_or_optimizer_decides_on_every_rank(
    ranks: Any, tmp_path: Path, case: str, world: int, named: list[str]
) -> None:
    """Each of these is refused before any step, by its rule, on every rank (the parameter
    server's server rank too, which checks the optimizer it would step)."""
    for text in ranks(world, _initialize, case, str(tmp_path), timeout=60):
        assert all(n in text for n in named), text
