"""Pipeline stages split by measured cost (``pipeline.partition = "measured"``, the default when
an example input is given): the boundary choice on synthetic costs, the split of a model whose
last layer is expensive, one split on every rank whatever each rank would measure, and a
profile that leaves the model, its gradients and the random streams as they were. Training
through a measured split against plain PyTorch is ``test_pipeline.py``'s equivalence tests."""

from __future__ import annotations

import itertools
import logging
import math
from contextlib import nullcontext
from typing import Any
from unittest import mock

import harness
import pytest
import torch
from torch import nn

import longboat
from longboat.config import ConfigError
from longboat.pipeline import LayerSpec, PipelineModule, measure, partition, schedules
from longboat.pipeline.measure import LayerCosts

# -- the boundary choice, on synthetic costs ----------------------------------------------------


def _bottleneck(costs: list[float], bounds: list[int]) -> float:
    return max(sum(costs[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1))


@pytest.mark.parametrize("seed", range(20))
def test_measured_split_has_the_smallest_slowest_stage(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    stages = int(torch.randint(1, n + 1, (1,), generator=g))
    costs = (torch.rand(n, generator=g, dtype=torch.float64) * 0.05).tolist()
    bounds = partition.measured(costs, stages)
    assert len(bounds) == stages + 1 and bounds[0] == 0 and bounds[-1] == n
    assert all(b > a for a, b in itertools.pairwise(bounds)), "every stage holds a layer"
    best = min(
        _bottleneck(costs, [0, *cuts, n])
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )
    assert _bottleneck(costs, bounds) == pytest.approx(best, abs=2e-9)  # to the nanosecond


def test_measured_split_breaks_ties_the_same_way_every_time():
    # equal layers: several splits are equally slow; earlier stages take as much as they can
    assert partition.measured([0.001] * 5, 2) == [0, 3, 5]
    assert partition.measured([0.001] * 6, 3) == [0, 2, 4, 6]
    # a heavy last layer alone; the cheap ones share the rest
    assert partition.measured([0.001, 0.001, 0.001, 0.001, 0.02], 2) == [0, 4, 5]
    # a layer without work (a function) goes with the stage before it
    assert partition.measured([0.0, 0.003, 0.0, 0.003], 2) == [0, 3, 4]


def test_partition_methods_by_name_with_measured_costs():
    kw: dict[str, Any] = {
        "parameters": [100, 10, 10, 1],
        "class_names": ["Embedding", "Block", "Block", "Linear"],
        "seconds": [0.001, 0.002, 0.002, 0.01],
    }
    assert partition.partition(None, 2, **kw) == [0, 3, 4], "measured, the default"
    assert partition.partition("Measured", 2, **kw) == [0, 3, 4]
    assert partition.partition("parameters", 2, **kw) == [0, 1, 4]
    assert partition.partition("uniform", 2, **kw) == [0, 2, 4]
    assert partition.partition([0, 2, 4], 2, **kw) == [0, 2, 4]
    # without measured costs the default balances parameters
    assert partition.partition(None, 2, **{**kw, "seconds": None}) == [0, 1, 4]


@pytest.mark.parametrize(
    ("seconds", "stages", "words"),
    [
        ([0.1, 0.2, 0.3], 4, ["measured", "3 layer(s)", "4 pipeline stages", "mesh.pp"]),
        ([0.1, -0.2], 2, ["measured", ">= 0"]),
        ([0.1, math.nan], 2, ["measured", ">= 0"]),
        (None, 2, ["'measured' needs", "example_input"]),
    ],
)
def test_measured_split_refusals_say_what_to_change(seconds, stages, words):
    with pytest.raises(partition.PartitionError) as e:
        partition.partition(
            "measured", stages, parameters=[1, 1, 1], class_names=["A"] * 3, seconds=seconds
        )
    for w in words:
        assert w in str(e.value)


def test_the_simulator_takes_a_cost_per_stage():
    plan = schedules.build("gpipe", 2, 2)
    # by hand: rank 1 runs F0 1-4, F1 4-7, B0 7-13, B1 13-19; rank 0 F0 0-1, F1 1-2, then
    # B0 13-15 and B1 19-21: busy 6 and 18 of 21
    timeline = plan.simulate([1.0, 3.0], [2.0, 6.0])
    assert timeline.makespan == 21.0
    assert timeline.bubble == pytest.approx((15 / 21, 3 / 21))
    # equal stages give the theory, as one cost for all does
    assert plan.simulate([1.0, 1.0], [2.0, 2.0]).bubble == plan.simulate(1.0, 2.0).bubble
    with pytest.raises(ValueError, match="3 forward costs given for 2 stages"):
        plan.simulate([1.0, 1.0, 1.0], 2.0)


# -- a model whose last layer is expensive ------------------------------------------------------


class HeavyHead(nn.Module):
    """Few parameters, much work: the same small matmul many times over (as a head over a
    large vocabulary is the most expensive layer of a GPT while a block holds more weights)."""

    def __init__(self, d: int, repeats: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            x = torch.tanh(x @ self.weight)
        return x


def _heavy_head_model() -> nn.Sequential:
    torch.manual_seed(0)
    # the head holds as many parameters as each Linear and costs far more than all of them
    return nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(5)], HeavyHead(32, 300))


def _split_of(cfg: dict[str, Any], fake: bool) -> dict[str, Any]:
    """This rank's view of the split of the heavy-head model: its boundaries, what rank 0
    announced, and the predicted idle. ``fake``: each rank's measurement says a different layer
    is the heavy one (if each used its own, they would not agree)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("longboat").addHandler(handler)
    rank = torch.distributed.get_rank()

    def differs(layers: Any, example: Any, model: nn.Module) -> LayerCosts:
        costs = [0.001] * 6
        costs[5 - rank] = 0.05
        return LayerCosts(tuple(costs), tuple(costs), (0,) * 6)

    model = _heavy_head_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    example = torch.randn(4, 32)
    try:
        with mock.patch.object(measure, "measure", differs) if fake else nullcontext():
            engine = longboat.initialize(model, opt, cfg, example_input=example)
        idle = engine.schedule.predicted_idle(4)
        bounds = engine.module.bounds
        engine.close()
    finally:
        logging.getLogger("longboat").removeHandler(handler)
    return {"bounds": bounds, "log": records, "idle": idle}


def _cfg(pp: int) -> dict[str, Any]:
    return {
        "log": {"progress": False, "level": "INFO"},
        "mesh": {"pp": pp},
        "batch": {"train_batch_size": 16, "micro_batch_size": 4},
    }


def test_the_expensive_last_layer_gets_a_stage_of_its_own(ranks):
    # by parameters the six equal-sized layers split 3 + 3; by time the head stands alone
    assert PipelineModule(list(_heavy_head_model())).boundaries(2, "parameters") == [0, 3, 6]
    results = ranks(2, _split_of, _cfg(2), False)
    assert [r["bounds"] for r in results] == [[0, 5, 6]] * 2
    log = "\n".join(results[0]["log"])
    assert "stage 0: layers 0-4 (5 Linear)" in log and "stage 1: layers 5-5 (HeavyHead)" in log
    assert "ms forward+backward per micro-batch" in log
    assert "predicted idle with the measured stages: rank 0" in log
    # the cheap stage waits for the expensive one: the simulator says it idles more
    idle = results[0]["idle"]
    assert results[1]["idle"] == idle and idle[0] > idle[1]


def test_every_rank_splits_by_rank_zeros_measurement(ranks):
    # rank r's own measurement would make layer 5 - r the heavy one
    results = ranks(2, _split_of, _cfg(2), True)
    assert [r["bounds"] for r in results] == [[0, 5, 6]] * 2


def test_the_default_without_an_example_input_balances_parameters(ranks):
    results = ranks(2, _split_without_example, _cfg(2))
    assert [r["bounds"] for r in results] == [[0, 3, 6]] * 2
    assert any("split by parameters" in m and "example_input" in m for m in results[0]["log"])


def _split_without_example(cfg: dict[str, Any]) -> dict[str, Any]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("longboat").addHandler(handler)
    try:
        model = _heavy_head_model()
        engine = longboat.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
        bounds = engine.module.bounds
        engine.close()
    finally:
        logging.getLogger("longboat").removeHandler(handler)
    return {"bounds": bounds, "log": records}


def _asks_measured_without_example(cfg: dict[str, Any]) -> str:
    model = _heavy_head_model()
    try:
        longboat.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    except ConfigError as e:
        return str(e)
    return "initialised"


def test_asking_for_measured_without_an_example_input_is_refused_by_key(ranks):
    cfg = {**_cfg(2), **harness.QUIET, "pipeline": {"partition": "measured"}}
    for message in ranks(2, _asks_measured_without_example, cfg):
        assert "'pipeline.partition' = 'measured'" in message and "example_input" in message


# -- the profile leaves everything as it was ----------------------------------------------------


class _Normed(nn.Module):
    """Dropout draws random numbers, BatchNorm updates running statistics in training."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.norm(self.lin(x)))


def test_measuring_leaves_parameters_buffers_grads_and_rng_untouched():
    torch.manual_seed(1)
    model = PipelineModule(
        [_Normed(), lambda x: x * 2, LayerSpec(nn.Linear, 6, 6), nn.BatchNorm1d(6), _Normed()]
    )
    model.train()
    x = torch.randn(8, 6)
    model.get_submodule("0").lin.weight.grad = torch.full((6, 6), 3.0)  # a grad already there
    grads = {
        n: (p.grad, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()
    }
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()

    costs = measure.measure(model.runnable_layers(), x, model)

    assert len(costs) == 5 and all(t > 0 for t in costs.total_s[:1] + costs.total_s[2:])
    assert costs.activation_bytes[0] > 0, "a BatchNorm saves its input for the backward"
    assert torch.equal(torch.get_rng_state(), rng), "the random stream moved"
    after = model.state_dict()
    assert after.keys() == state.keys()
    for k, v in state.items():  # weights, running statistics and the batch counters
        assert torch.equal(after[k], v), k
    for n, p in model.named_parameters():
        before, values = grads[n]
        assert p.grad is before, f"{n}.grad was replaced"
        if values is not None:
            assert torch.equal(p.grad, values), n


def _measures_a_wrong_example(cfg: dict[str, Any]) -> str:
    model = _heavy_head_model()
    try:
        longboat.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            cfg,
            example_input=torch.randn(4, 7),  # the first layer takes 32 features
        )
    except RuntimeError as e:
        return str(e)
    return "initialised"


def test_a_failed_measurement_stops_every_rank(ranks):
    first, second = ranks(2, _measures_a_wrong_example, {**_cfg(2), **harness.QUIET})
    assert "4x7" in first, "rank 0 raises the layer's own error"
    assert "rank 0 could not time the layers" in second, "the other ranks stop too, not wait"


@pytest.mark.parametrize("partition", [None, "measured", "uniform"])
def test_config_explain_shows_a_timed_split_by_parameters_and_says_so(tmp_path, partition):
    from longboat.cli.config import _stages

    cfg = tmp_path / "pp.toml"
    text = "[batch]\nmicro_batch_size = 4\n[mesh]\npp = 2\n"
    cfg.write_text(text + (f'[pipeline]\npartition = "{partition}"\n' if partition else ""))
    shown = _stages(cfg, 2, "reference-gpt", None)
    assert "stage 0: layers 0-2" in shown  # by parameters, or by layers: 3 + 3
    assert ("a run given example_input splits by" in shown) == (partition != "uniform")


# [Note: the loss in the profile]: the last stage's loss is part of its cost. Removing the stand-in
# loss from measure.measure fails the first test; timing it on outputs without classes fails the
# second.


def test_the_last_piece_is_timed_with_a_cross_entropy_over_its_output() -> None:
    model = PipelineModule([nn.Linear(8, 16), nn.Linear(16, 50)])
    seen: list[tuple[int, ...]] = []
    least = measure._least

    def spy(layer: Any, x: Any, own: set[int], repeats: int) -> tuple[float, float, int, Any]:
        seen.append(tuple(x.shape))
        f, b, n, out = least(layer, x, own, repeats)
        if len(seen) == 3:  # the loss: its own time, and a scalar out of the logits
            assert out.dim() == 0 and 0 < f < math.inf and 0 < b < math.inf
            return 100.0, 200.0, n, out
        return f, b, n, out

    with mock.patch.object(measure, "_least", spy):
        costs = measure.measure(model.runnable_layers(), torch.randn(4, 3, 8), model)
    assert seen == [(4, 3, 8), (4, 3, 16), (4, 3, 50)], "the loss timed once, on the logits"
    assert costs.forward_s[-1] > 100.0 and costs.backward_s[-1] > 200.0
    assert costs.forward_s[0] < 100.0 and costs.backward_s[0] < 200.0
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "last", [lambda x: x.sum(-1), lambda x: (x > 0).long()], ids=["one-dim", "integers"]
)
def test_an_output_without_classes_adds_no_loss(last: Any) -> None:
    model = PipelineModule([nn.Linear(8, 5), last])
    calls: list[Any] = []
    least = measure._least

    def spy(*a: Any) -> Any:
        calls.append(a)
        return least(*a)

    with mock.patch.object(measure, "_least", spy):
        costs = measure.measure(model.runnable_layers(), torch.randn(4, 8), model)
    assert len(costs) == 2 and len(calls) == 2, "no loss timed"
