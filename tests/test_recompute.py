"""Activation checkpointing by config: the same computation as the plain loop under every
strategy (recomputation changes memory, never results), recomputation that really happens, and
refusals that name the key."""

from __future__ import annotations

import harness
import pytest
import reference
import torch
from torch import nn

import longboat
from longboat.config import ConfigError

STEPS = 6
GLOBAL_BATCH = 16
RECOMPUTE = {"activation_checkpointing": {"classes": ["Linear"]}}

STRATEGIES = {
    "single": {"strategy": "single"},
    "replicate": {"strategy": "replicate"},
    "zero1": {"strategy": "zero", "zero": {"stage": 1, "bucket_mb": 0.001}},
    "zero2": {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.001}},
    # the recomputed modules are ZeRO-3's units: gathered again for the recomputation
    "zero3": {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear", "LayerNorm"]}},
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_recomputation_equals_plain_pytorch(ranks, strategy):
    world = 1 if strategy == "single" else 2
    recipe = reference.Recipe(model="tiny", optimizer="adamw", clip=0.5)
    harness.run_and_compare(
        ranks, world, STRATEGIES[strategy], recipe, STEPS, 2, GLOBAL_BATCH, tol=1e-5, **RECOMPUTE
    )


class _Counted(nn.Linear):
    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return super().forward(x)


def _engine(model: nn.Module, recompute: dict) -> longboat.Engine:
    cfg = {
        **harness.QUIET,
        "strategy": "single",
        "activation_checkpointing": recompute,
        "batch": {"train_batch_size": 4},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    return longboat.initialize(model, None, cfg)


@pytest.mark.parametrize(("every", "per_step"), [(1, 6), (2, 5)])
def test_chosen_modules_run_again_in_backward(every, per_step):
    torch.manual_seed(0)
    model = nn.Sequential(_Counted(4, 4), nn.Tanh(), _Counted(4, 4), nn.Tanh(), _Counted(4, 2))
    engine = _engine(model, {"classes": ["_Counted"], "every": every})
    _Counted.calls = 0
    engine.train_step((torch.randn(4, 4), torch.zeros(4, dtype=torch.long)), _ce)
    assert _Counted.calls == per_step  # 3 forwards, and one more per recomputed module
    _Counted.calls = 0
    with torch.no_grad():  # evaluation runs each module once
        engine(torch.randn(4, 4))
    assert _Counted.calls == 3
    assert next(n for n, _ in engine.model.named_parameters()) == "0.weight"
    engine.close()


def _ce(out: torch.Tensor, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(out, mb[1])


def test_classes_that_match_nothing_are_refused_by_key():
    with pytest.raises(ConfigError) as e:
        _engine(nn.Sequential(nn.Linear(4, 4)), {"classes": ["Block"]})
    assert "activation_checkpointing.classes" in str(e.value) and "Linear" in str(e.value)


def test_a_module_holding_batchnorm_is_refused():
    class Unit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.lin(x))

    with pytest.raises(ConfigError, match="holds BatchNorm"):
        _engine(nn.Sequential(Unit(), nn.Linear(4, 2)), {"classes": ["Unit"]})
