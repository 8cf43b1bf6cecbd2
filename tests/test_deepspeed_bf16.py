"""DeepSpeed's ``"bf16": {"enabled": true}`` is bf16 parameters with fp32 masters where the
compositions take ``precision.param_dtype`` (ZeRO stages 1-3), and bf16 autocast over fp32
parameters, as before, where they do not, with one log line naming the key and why ([Note:
DeepSpeed's bf16] in longboat/config/deepspeed.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import harness
import pytest
import reference
from test_param_dtype import GLOBAL_BATCH, STEPS, TOL

from longboat.config import ConfigError, explain, load_config

BF16 = {"train_batch_size": 8, "bf16": {"enabled": True}}


def _said(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if "'bf16.enabled'" in r.getMessage()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_under_zero_is_bf16_parameters(caplog: Any, stage: int) -> None:
    with caplog.at_level(logging.INFO, logger="longboat"):
        cfg = load_config({**BF16, "zero_optimization": {"stage": stage}})
    assert (cfg.strategy, cfg.zero.stage) == ("zero", stage)
    assert (cfg.precision.dtype, cfg.precision.param_dtype) == ("bf16", "bf16")
    assert _said(caplog) == []


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({}, "strategy = 'auto'"),
        ({"zero_optimization": {"stage": 0}}, "strategy = 'replicate'"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            "zero offload",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
            "zero offload",
        ),
        ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}, "mesh.pp = 2"),
    ],
)
def test_bf16_where_param_dtype_is_refused_stays_autocast(
    caplog: Any, extra: dict[str, Any], why: str
) -> None:
    """The config loads as it did before (bf16 autocast, fp32 parameters), and one line names
    the key and the composition table's refusal."""
    with caplog.at_level(logging.INFO, logger="longboat"):
        cfg = load_config({**BF16, **extra})
    assert (cfg.precision.dtype, cfg.precision.param_dtype) == ("bf16", None)
    said = _said(caplog)
    assert len(said) == 1, said
    assert "bf16 autocast over fp32 parameters" in said[0] and why in said[0], said


def test_a_config_refused_either_way_keeps_its_own_error() -> None:
    """A DeepSpeed config refused before is refused with the same words, not param_dtype's."""
    ds = {**BF16, "zero_optimization": {"stage": 2}, "optimizer": {"type": "OneBitAdam"}}
    with pytest.raises(ConfigError, match="OneBitAdam") as err:
        load_config(ds)
    assert "param_dtype" not in str(err.value)


def test_config_explain_shows_the_mapping(tmp_path: Path) -> None:
    low, amp = tmp_path / "low.json", tmp_path / "amp.json"
    low.write_text(json.dumps({**BF16, "zero_optimization": {"stage": 2}}))
    amp.write_text(json.dumps({**BF16, "zero_optimization": {"stage": 0}}))
    rows = {ln.split()[0]: ln for ln in explain(str(low), 2).splitlines()[1:]}
    assert "'bf16'" in rows["precision.param_dtype"]
    assert "DeepSpeed key 'bf16.enabled'" in rows["precision.param_dtype"]
    assert "fp32 master weights" in rows["precision.param_dtype"]
    rows = {ln.split()[0]: ln for ln in explain(str(amp), 2).splitlines()[1:]}
    assert "None" in rows["precision.param_dtype"] and "not taken" in rows["precision.param_dtype"]
    assert "autocast over fp32 parameters" in rows["precision.dtype"]


@pytest.mark.parametrize("stage", [1, 2])
def test_a_deepspeed_bf16_config_trains_as_the_plain_loop(ranks: Any, stage: int) -> None:
    """A DeepSpeed JSON with bf16 under ZeRO-1/2 on the zoo model at 2 ranks, 2 micro-batches
    a step, against the plain autocast loop within test_param_dtype's 8u."""
    recipe = reference.Recipe(model="zoo", optimizer="adamw", clip=0.5, precision="bf16")
    world, accum = 2, 2
    ds = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": recipe.clip,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 128},
    }
    assert load_config(ds).precision.param_dtype == "bf16"
    results = ranks(world, harness.train, recipe, ds, STEPS)
    order = harness.order_of(results)
    plain = reference.plain_train(recipe, harness.data_for(recipe, GLOBAL_BATCH * STEPS), order)
    harness.compare(results, plain, TOL)
