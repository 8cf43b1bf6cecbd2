"""Shared pieces of the 1-bit optimizer tests (tests/test_onebit_adam.py,
tests/test_onebit_lamb.py): the run under replicate, its check against the plain simulation
(tests/onebit_sim.py), resuming after the freeze, the config's refusals and the digits example.

Each test file gives its optimizer as ``make(params, freeze)``, a module-level function, so that
the ranks can be sent it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import onebit_sim
import pytest
import reference
import torch

import longboat
from longboat.config import ConfigError, load_config

FREEZE = 3
GLOBAL_BATCH = 16
TOL = 1e-5
RECIPE = reference.Recipe(model="zoo")
REPLICATE = {"strategy": "replicate", "replicate": {"bucket_mb": 0.001}}

#: (parameters, freeze_step) -> the optimizer under test
Make = Callable[[Any, int], torch.optim.Optimizer]
Simulated = tuple[list[list[float]], Any, Any]


def config(world: int) -> dict[str, Any]:
    """Replicate at ``world`` ranks, one micro-batch of GLOBAL_BATCH // world per step."""
    return harness.config(REPLICATE, RECIPE, GLOBAL_BATCH, GLOBAL_BATCH // world)


def simulate(order: list[list[list[int]]], rule: onebit_sim.Rule) -> Simulated:
    """The plain simulation of the ranks on the samples of ``order`` ([step][rank] -> ids):
    losses [step][rank], the state_dict and the optimizer state by parameter name."""
    data = harness.data_for(RECIPE, GLOBAL_BATCH * len(order))
    return onebit_sim.simulate(RECIPE, data, order, rule)


def order_of(results: list[dict[str, Any]], steps: int) -> list[list[list[int]]]:
    """[step][rank] -> the sample ids that rank saw in that step."""
    return [[res["ids"][s] for res in results] for s in range(steps)]


def train(cfg: dict[str, Any], make: Make, steps: int, freeze: int) -> dict[str, Any]:
    """On each rank: ``steps`` steps of ``make``'s optimizer freezing at ``freeze``."""
    make_optimizer = functools.partial(make, freeze=freeze)
    return harness.train_self_reducing(cfg, RECIPE, make_optimizer, GLOBAL_BATCH, steps)


def check(results: list[dict[str, Any]], simulated: Simulated, keys: tuple[str, ...]) -> None:
    """The run against the simulation: losses, parameters and buffers, the optimizer state
    (``step`` and ``keys``), TOL relative."""
    harness.check_simulated(results, simulated, keys, TOL)
    # the never-used and the frozen parameter have no optimizer state (nor in the simulation)
    assert not {"never", "frozen.weight"} & harness.assemble(results).keys()


def _optimizer_state(
    module: torch.nn.Module, opt: torch.optim.Optimizer
) -> dict[str, dict[str, torch.Tensor]]:
    """A copy of ``opt``'s state by the name of its parameter in ``module``."""
    return {
        name: {k: torch.as_tensor(v).clone() for k, v in opt.state[p].items()}
        for name, p in module.named_parameters()
        if p in opt.state
    }


def resume(cfg: dict[str, Any], directory: str, make: Make) -> dict[str, Any]:
    """Train 5 steps (freeze at FREEZE), save; a fresh engine loads it and takes one more step.
    The state and optimizer state saved and loaded (``same``: every piece of the optimizer
    state came back equal), whether the next step was to be compressed, whether the variance
    stayed frozen in it, whether its gradients stayed local, and the steps taken."""
    model, _, _ = RECIPE.build()
    engine = longboat.initialize(model, make(model.parameters(), FREEZE), cfg)
    for _, *batch in engine.loader(harness.data_for(RECIPE, GLOBAL_BATCH * 5)):
        engine.backward(reference.forward_loss(engine, batch))
        engine.step()
        if engine.global_step == 5:
            break
    engine.save_checkpoint(directory, tag="five")
    saved = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    saved_state = _optimizer_state(engine.module, engine.optimizer)
    engine.close()

    model, _, _ = RECIPE.build()
    opt = make(model.parameters(), FREEZE)
    engine = longboat.initialize(model, opt, cfg)
    engine.load_checkpoint(directory)
    loaded = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    loaded_state = _optimizer_state(engine.module, opt)
    v_loaded = {id(p): s["exp_avg_sq"].clone() for p, s in opt.state.items()}
    compressed_next = opt.longboat_reduces_gradients()
    for _, *batch in engine.loader(harness.data_for(RECIPE, GLOBAL_BATCH * 8)):
        engine.backward(reference.forward_loss(engine, batch))
        engine.step()
        break
    frozen = all(torch.equal(s["exp_avg_sq"], v_loaded[id(p)]) for p, s in opt.state.items())
    out = {
        "saved": saved,
        "loaded": loaded,
        "same": saved_state.keys() == loaded_state.keys()
        and all(
            torch.equal(saved_state[n][k], loaded_state[n][k])
            for n in saved_state
            for k in saved_state[n]
        ),
        "compressed_next": compressed_next,
        "frozen": frozen,
        "local": engine.strategy._local,
        "steps": opt.steps_taken(),
    }
    engine.close()
    return out


def check_refused(optimizer: str, extra: dict[str, Any], named: list[str]) -> None:
    """A config with optimizer type ``optimizer`` and ``extra`` is refused, naming ``named``."""
    cfg = {"batch": {"train_batch_size": 8}, "optimizer": {"type": optimizer}, **extra}
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    for n in named:
        assert n in str(e.value), str(e.value)


def check_digits_converge(ranks: Any, tmp_path: Path, name: str, optimizer: str) -> None:
    """The digits example at 2 ranks with ``optimizer`` (its TOML section) reaches 0.95."""
    config = harness.digits_config(optimizer)
    accuracy, out = harness.digits_accuracy(ranks, tmp_path, name, config)
    assert accuracy >= 0.95, out[-2000:]
