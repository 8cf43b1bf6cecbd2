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


# -- cpu_checkpointing ([Note: cpu checkpointing]) ----------------------------------------------

CPU_CHECKPOINTING = {"activation_checkpointing": {"classes": ["Linear"], "cpu_checkpointing": True}}


def test_deepspeed_cpu_checkpointing_is_translated():
    from longboat.config import load_config

    block = {"partition_activations": True, "cpu_checkpointing": True}
    cfg = load_config({"train_batch_size": 8, "activation_checkpointing": block})
    assert cfg.activation_checkpointing.cpu_checkpointing is True
    cfg = load_config({"train_batch_size": 8, "activation_checkpointing": {}})
    assert cfg.activation_checkpointing.cpu_checkpointing is False


def test_cpu_checkpointing_on_a_cpu_device_logs_that_it_has_no_effect(capfd):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    cfg = {
        "log": {"progress": False},
        "strategy": "single",
        **CPU_CHECKPOINTING,
        "batch": {"train_batch_size": 4},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    longboat.initialize(model, None, cfg).close()
    out, err = capfd.readouterr()
    said = [line for line in (out + err).splitlines() if "cpu_checkpointing" in line]
    assert len(said) == 1 and said[0].endswith(
        "activation_checkpointing.cpu_checkpointing has no effect on a CPU device: the "
        "recomputed modules' inputs are in CPU memory already"
    ), said


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_checkpointing_on_a_cpu_device_trains_as_plain_pytorch(ranks, world):
    strategy = STRATEGIES["single" if world == 1 else "replicate"]
    recipe = reference.Recipe(model="tiny", optimizer="adamw", clip=0.5)
    harness.run_and_compare(
        ranks, world, strategy, recipe, STEPS, 2, GLOBAL_BATCH, tol=1e-5, **CPU_CHECKPOINTING
    )


def test_on_an_accelerator_the_checkpointed_inputs_go_through_save_on_cpu(monkeypatch):
    """The wiring, seen on CPU: for a device that is not the CPU, the recomputed module runs its
    checkpoint under save_on_cpu, whose pack hook sees the module's input; results unchanged."""
    import longboat.recompute as recompute
    from longboat.config import ActivationCheckpointingConfig

    packed: list[tuple[int, ...]] = []
    real = torch.autograd.graph.save_on_cpu

    class Spy(real):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory=pin_memory, device_type=device_type)
            pack = self.pack_hook
            self.pack_hook = lambda t: (packed.append(tuple(t.shape)), pack(t))[1]

    monkeypatch.setattr(recompute, "save_on_cpu", Spy)

    def run(device: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        cfg = ActivationCheckpointingConfig(classes=["Linear"], cpu_checkpointing=True)
        recompute.apply_activation_checkpointing(
            model, cfg, torch.device(device) if device else None
        )
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        loss = model(x).square().sum()
        loss.backward()
        return loss.detach(), model[0].weight.grad

    plain = run(None)
    assert packed == []
    offloaded = run("meta")  # any device that is not the CPU
    assert packed == [(3, 4), (3, 6)]  # each recomputed Linear's input, nothing else
    assert torch.equal(plain[0], offloaded[0]) and torch.equal(plain[1], offloaded[1])
