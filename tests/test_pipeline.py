"""Pipeline parallelism: partitions and schedules as data (no processes), and training through
stages against the plain PyTorch loop of ``reference.py`` (every micro-batch's loss, every
step's loss, parameters and optimizer state)."""

from __future__ import annotations

import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import harness
import pytest
import reference
import test_launcher
import torch
from torch import nn

import longboat
from longboat.config import ConfigError
from longboat.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, partition, schedules
from longboat.pipeline.schedules import Action, PipelineSchedule, ScheduleError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# -- partitions --------------------------------------------------------------------------------


def _brute_bottleneck(weights: list[int], stages: int) -> int:
    n = len(weights)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = [0, *cuts, n]
        best = min(best, max(sum(weights[b[i] : b[i + 1]]) for i in range(stages)))
    return int(best)


@pytest.mark.parametrize("seed", range(30))
def test_balanced_partition_has_the_smallest_bottleneck(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    stages = int(torch.randint(1, n + 1, (1,), generator=g))
    weights = torch.randint(0, 50, (n,), generator=g).tolist()
    bounds = partition.balanced(weights, stages)
    assert len(bounds) == stages + 1 and bounds[0] == 0 and bounds[-1] == n
    assert all(b > a for a, b in itertools.pairwise(bounds)), "every stage holds a layer"
    got = max(sum(weights[bounds[i] : bounds[i + 1]]) for i in range(stages))
    assert got == _brute_bottleneck(weights, stages)


def test_partition_methods_have_deepspeeds_meanings():
    params = [100, 0, 10, 10, 10, 10, 0, 100]
    names = ["Embedding", "Dropout", "Block", "Block", "Block", "Block", "LayerNorm", "Linear"]
    kw = {"parameters": params, "class_names": names}
    assert partition.partition("uniform", 3, **kw) == [0, 3, 6, 8]
    assert partition.partition("parameters", 2, **kw) == [0, 4, 8]
    # two Blocks per stage, whatever the other layers weigh
    bounds = partition.partition("type:block", 2, **kw)
    assert [names[bounds[s] : bounds[s + 1]].count("Block") for s in range(2)] == [2, 2]
    assert partition.partition([0, 5], 2, **kw) == [0, 5, 8]
    assert partition.partition([0, 5, 8], 2, **kw) == [0, 5, 8]


@pytest.mark.parametrize(
    ("method", "stages", "words"),
    [
        ("type:Attention", 2, ["matches no layer", "Block", "Embedding"]),
        ("type:(", 2, ["not a regular expression"]),
        ("balanced", 2, ["unknown", "parameters", "uniform", "type:REGEX"]),
        ("uniform", 9, ["8 layer(s)", "9 pipeline stages", "mesh.pp"]),
        ([0, 5, 4], 2, ["boundaries [0, 5, 4]", "strictly increasing", "[0, 4, 8]"]),
        ([1, 8], 2, ["from 0 to 8"]),
    ],
)
def test_partition_refusals_say_what_to_change(method, stages, words):
    names = ["Embedding", "Dropout", "Block", "Block", "Block", "Block", "LayerNorm", "Linear"]
    with pytest.raises(partition.PartitionError) as e:
        partition.partition(method, stages, parameters=[1] * 8, class_names=names)
    for w in words:
        assert w in str(e.value)


def test_a_rank_builds_only_its_own_layers():
    built: list[int] = []

    class Counted(nn.Linear):
        def __init__(self, i: int) -> None:
            super().__init__(4, 4)
            if self.weight.device.type != "meta":
                built.append(i)

    module = PipelineModule([LayerSpec(Counted, i) for i in range(6)], partition="uniform")
    assert list(module.parameters()) == [] and built == []  # counted on the meta device
    module.bind(module.boundaries(3), held=[1])
    assert built == [2, 3]
    # the names of a plain nn.Sequential of the same layers, whichever stage holds them
    assert [n for n, _ in module.named_parameters()] == [
        "2.weight",
        "2.bias",
        "3.weight",
        "3.bias",
    ]
    assert "stage 1: layers 2-3 (2 Counted), 40 trainable parameters" in [
        s.describe() for s in module.stage_info(module.bounds)
    ]
    with pytest.raises(ValueError, match="holds stages \\[1\\], not stage 0"):
        module(torch.zeros(1, 4), stage=0)


def test_a_parameter_shared_across_stages_is_tied_not_copied():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    module = PipelineModule([a, nn.Tanh(), b], partition="uniform")
    ((tie, param),) = module.bind([0, 2, 3], held=[1])
    assert (tie.name, tie.stages, param) == ("0.weight", (0, 1), a.weight)
    # the second stage holds its own layer and, under its first name, the tied weight
    assert [n for n, _ in module.named_parameters()] == ["0.weight", "2.bias"]


def test_an_unsplit_pipeline_module_is_the_sequential_model():
    torch.manual_seed(0)
    seq = reference.chain_net()
    module = PipelineModule(list(seq))
    x = torch.randn(3, 12)
    assert torch.equal(module(x), seq(x))
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in seq.named_parameters()]


# -- schedules ---------------------------------------------------------------------------------

SIZES = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8, 12)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_one_stage_per_rank_schedules_meet_the_theory(kind, p, m):
    if kind == "1f1b" and m < p:
        with pytest.raises(ScheduleError, match=f"{m} micro-batch\\(es\\) cannot fill {p}"):
            schedules.build(kind, p, m)
        return
    sched = schedules.build(kind, p, m)  # validates: complete, on the right ranks, no deadlock
    for cost_b in (1.0, 2.0):
        t = sched.simulate(backward_cost=cost_b)
        for bubble in t.bubble:
            assert bubble == pytest.approx(schedules.bubble_theory(p, m))
    peak = sched.simulate().peak_in_flight
    if kind == "gpipe":
        assert peak == (m,) * p
    else:  # 1F1B holds at most p - r micro-batches' activations on rank r
        assert peak == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 4, 2), (4, 8, 2), (2, 6, 3), (3, 9, 2)])
def test_interleaved_shrinks_the_bubble_by_the_virtual_stages(p, m, v):
    sched = schedules.build("interleaved", p, m, v)
    assert sched.stages_of(0) == [c * p for c in range(v)]
    for bubble in sched.simulate().bubble:
        assert bubble == pytest.approx(schedules.bubble_theory(p, m, v))
        assert bubble < schedules.bubble_theory(p, m)


@pytest.mark.parametrize(
    ("kind", "p", "m", "v", "words"),
    [
        ("interleaved", 2, 3, 2, ["3 micro-batch(es)", "groups of 2", "multiple of 2"]),
        ("interleaved", 1, 2, 2, ["at least 2 pipeline ranks"]),
        ("gpipe", 2, 4, 2, ["virtual stages", "interleaved"]),
        ("zigzag", 2, 4, 1, ["'zigzag' is unknown", "gpipe", "1f1b", "interleaved", "zb-h1"]),
    ],
)
def test_schedule_refusals(kind, p, m, v, words):
    with pytest.raises(ScheduleError) as e:
        schedules.build(kind, p, m, v)
    for w in words:
        assert w in str(e.value)


def test_validation_catches_a_deadlock_and_messages_out_of_order():
    good = schedules.build("1f1b", 2, 2)
    # rank 1 waits for the gradient of micro-batch 0 before it has run its forward
    swapped = list(good.actions)
    swapped[0] = (Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0))
    swapped[1] = (Action("B", 0, 1), Action("F", 0, 1), Action("F", 1, 1), Action("B", 1, 1))
    bad = PipelineSchedule("1f1b", 2, 2, 1, tuple(swapped))
    with pytest.raises(ScheduleError, match="would deadlock: rank 0 waits in B0; rank 1 waits"):
        bad.validate()
    # rank 1 runs micro-batch 1 first: what rank 0 sends first is not what rank 1 expects first
    order = (Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0))
    late = (Action("F", 1, 1), Action("F", 0, 1), Action("B", 1, 1), Action("B", 0, 1))
    with pytest.raises(ScheduleError, match="rank 0 sends rank 1 \\('act', 0, 0\\)"):
        PipelineSchedule("gpipe", 2, 2, 1, (order, late)).validate()
    print(good.describe())
    assert good.describe().splitlines() == [
        "1f1b: 2 rank(s), 2 micro-batches",
        "  rank 0: F0 F1 B0 B1",
        "  rank 1: F0 B0 F1 B1",
    ]


# -- training through stages, against the plain loop ------------------------------------------

STEPS = 6
GLOBAL_BATCH = 16


def _train(recipe: reference.Recipe, cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    """Train ``recipe`` with ``engine.train_step`` on this rank; record what the comparison
    needs (the sample ids of each micro-batch, the last stage's micro-batch losses, every
    step's loss on every rank, this stage's state)."""
    model, opt, sched = recipe.build()
    dp = torch.distributed.get_world_size() // cfg["mesh"]["pp"]
    if torch.distributed.get_rank() % dp:
        with torch.no_grad():  # the data-parallel strategy must start from its root's weights
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    # one micro-batch's inputs: the stages are split by the layers' measured cost (the default)
    example = harness.data_for(recipe, cfg["batch"]["micro_batch_size"]).tensors[1]
    engine = longboat.initialize(model, opt, cfg, scheduler=sched, example_input=example)
    mesh, coords = engine.topology.mesh, engine.topology.coords
    micro, accum = engine.batch.micro_batch_size, engine.accumulation_steps
    data = harness.data_for(recipe, engine.batch.train_batch_size * steps)
    out: dict[str, Any] = {"ids": [], "losses": [], "step_losses": [], "pp": coords["pp"]}
    out["dp"], out["last"] = coords["dp"], coords["pp"] == mesh.pp - 1
    for batch in engine.loader(data, per_step=True):
        ids = batch[0]
        micro_losses: list[float] = []

        def loss_fn(
            output: torch.Tensor, mb: Any, into: list[float] = micro_losses
        ) -> torch.Tensor:
            loss = nn.functional.cross_entropy(output.float(), mb[2])
            into.append(float(loss.detach()))
            return loss

        out["step_losses"].append(engine.train_step(batch, loss_fn, inputs=lambda mb: (mb[1],)))
        out["ids"].append([ids[i * micro : (i + 1) * micro].tolist() for i in range(accum)])
        out["losses"].append(micro_losses)
        if engine.global_step == steps:
            break
    out["state"] = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    out["optim"] = harness.optimizer_pieces(engine)
    out["lrs"] = opt.param_groups[0]["lr"]
    engine.close()
    return out


def _run(ranks, world: int, extra: dict[str, Any], accum: int, optimizer: str = "adamw"):
    recipe = reference.Recipe(model="chain", optimizer=optimizer, clip=0.5, scheduler=True)
    dp = world // extra["mesh"]["pp"]
    micro = GLOBAL_BATCH // (dp * accum)
    strategy = {k: extra.pop(k) for k in ("strategy", "zero") if k in extra}
    cfg = harness.config(strategy, recipe, GLOBAL_BATCH, micro, **extra)
    results = ranks(world, _train, recipe, cfg, STEPS)
    first = sorted((r for r in results if r["pp"] == 0), key=lambda r: r["dp"])
    order = [[[r["ids"][s][t] for r in first] for t in range(accum)] for s in range(STEPS)]
    for r in results:  # every stage of a data-parallel rank saw the same samples
        assert r["ids"] == first[r["dp"]]["ids"]
    plain = reference.plain_train(recipe, harness.data_for(recipe, GLOBAL_BATCH * STEPS), order)
    tol = 1e-5
    for r in results:
        for s in range(STEPS):
            want = plain.losses[s]  # [micro][dp rank]
            mean = sum(want[t][r["dp"]] for t in range(accum)) / accum
            assert r["step_losses"][s] == pytest.approx(mean, rel=tol), f"step {s + 1}"
            if r["last"]:
                got = r["losses"][s]
                assert got == pytest.approx([want[t][r["dp"]] for t in range(accum)], rel=tol)
            else:
                assert r["losses"][s] == [], "only the last stage computes a loss"
    state: dict[str, torch.Tensor] = {}
    for r in results:
        for k, v in r["state"].items():
            if k in state:
                assert torch.equal(state[k], v), f"data-parallel ranks disagree on {k}"
            state[k] = v
    assert reference.max_rel_diff(state, plain.state) <= tol
    optim = harness.assemble(results)
    assert optim.keys() == plain.optim.keys()
    for name, want in plain.optim.items():
        for k, v in want.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert reference.max_rel_diff({k: optim[name][k]}, {k: v}) <= tol, (name, k)
            else:
                assert optim[name][k] == (v.item() if isinstance(v, torch.Tensor) else v)
    # what the model is for: a never-used parameter (no state), a layer used on some
    # micro-batches and not on others, a frozen one
    assert "2.unused" not in plain.optim and "6.weight" not in plain.optim
    gate = [("2.extra.weight" in u) for step in plain.used for micro in step for u in micro]
    assert any(gate) and not all(gate)
    return results, plain


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_equals_plain_pytorch(ranks, kind, stages):
    _run(ranks, stages, {"mesh": {"pp": stages}, "pipeline": {"schedule": kind}}, accum=4)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
def test_a_stage_of_a_layer_that_skips_its_branch_equals_plain_pytorch(ranks, kind):
    # The Gate alone on stage 1: on a micro-batch whose mean is negative it returns its input,
    # and the stage's output is the activation it received. zb-h1 sent zeros back for it
    # (the default partition, by measured time, put it there in about 1 run of 20).
    extra = {"mesh": {"pp": 4}, "pipeline": {"schedule": kind, "partition": [0, 2, 3, 5, 8]}}
    _run(ranks, 4, extra, accum=4)


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_pipeline_with_activation_checkpointing_equals_plain_pytorch(ranks, kind):
    extra = {
        "mesh": {"pp": 2},
        "pipeline": {"schedule": kind},
        "activation_checkpointing": {"classes": ["Linear", "Gate"]},
    }
    _run(ranks, 2, extra, accum=4)


@pytest.mark.parametrize("kind", ["interleaved", "interleaved-zb"])
def test_interleaved_equals_plain_pytorch(ranks, kind):
    extra = {"mesh": {"pp": 2}, "pipeline": {"schedule": kind, "virtual_stages": 2}}
    _run(ranks, 2, extra, accum=4)


def test_interleaved_zero_bubble_on_four_ranks_equals_plain_pytorch(ranks):
    # 8 stages of the 8-layer chain, one layer each: stage s on rank s % 4, so rank 2 holds
    # the gated layer (with its never-used parameter) and the frozen one, and rank 1 a
    # parameterless Tanh; rank 3's W's trail by 3 and run in both chunks' cool-down
    extra = {
        "mesh": {"pp": 4},
        "pipeline": {"schedule": "interleaved-zb", "virtual_stages": 2, "partition": "uniform"},
    }
    _run(ranks, 4, extra, accum=4)


@pytest.mark.parametrize(
    ("strategy", "schedule"),
    [
        ("replicate", "1f1b"),
        ("zero1", "1f1b"),
        ("zero2", "1f1b"),
        ("zero3", "1f1b"),
        # two stages per rank: the sync waits for the step's last backward of either
        ("replicate", "interleaved"),
        ("zero2", "interleaved"),
        # weight passes deferred: the sync waits for the step's last W
        ("replicate", "zb-h1"),
        ("zero2", "zb-h1"),
        # both: the last W of either stage
        ("replicate", "interleaved-zb"),
        ("zero2", "interleaved-zb"),
    ],
)
def test_pipeline_with_data_parallel_equals_plain_pytorch(ranks, strategy, schedule):
    # 2 stages x 2 data-parallel ranks: each stage's strategy runs over its own dp group
    extra: dict[str, Any] = {"mesh": {"pp": 2}, "strategy": strategy.rstrip("123")}
    extra["pipeline"] = {
        "schedule": schedule,
        "virtual_stages": 2 if schedule.startswith("interleaved") else 1,
    }
    if strategy.startswith("zero"):
        extra["zero"] = {"stage": int(strategy[-1]), "bucket_mb": 0.001}
    _run(ranks, 4, extra, accum=2, optimizer="sgd")


class _InfOnStep(nn.Module):
    """Multiplies by a weight of 1 whose gradient is inf during optimizer step ``bad`` (counted
    in training forwards of ``per_step`` micro-batches): an overflow on this layer's stage only."""

    def __init__(self, bad: int, per_step: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.bad, self.per_step, self.calls = bad, per_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w * 1.0  # a hook on this graph's copy lasts one backward
        if self.training and torch.is_grad_enabled():
            if self.calls // self.per_step == self.bad:
                w.register_hook(lambda g: g * math.inf)
            self.calls += 1
        return x * w


def _fp16_overflow_on_the_last_stage(kind: str) -> dict:
    torch.manual_seed(0)
    model = PipelineModule(
        [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), _InfOnStep(bad=1, per_step=2)],
        partition=[0, 2, 4],
    )
    cfg = {
        **harness.QUIET,
        "mesh": {"pp": 2},
        "pipeline": {"schedule": kind},
        "precision": {"dtype": "fp16", "initial_scale_power": 8, "hysteresis": 1},
        "batch": {"train_batch_size": 8, "gradient_accumulation_steps": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine = longboat.initialize(model, None, cfg)
    g = torch.Generator().manual_seed(1)
    states, scales = [], []
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
        engine.train_step((x, y), lambda out, mb: (out.float() - mb[1]).square().mean())
        states.append({k: v.detach().clone() for k, v in engine.state_dict().items()})
        scales.append(engine.precision.scaler.scale)
    out = {"skipped": engine.skipped_steps, "states": states, "scales": scales}
    engine.close()
    return out


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(ranks, kind):
    first, last = ranks(2, _fp16_overflow_on_the_last_stage, kind)
    # the inf exists on the last stage only; the first stage skips the same step
    assert first["skipped"] == last["skipped"] == 1
    assert first["scales"] == last["scales"] == [256.0, 128.0, 128.0]
    for r in (first, last):
        s0, s1, s2 = r["states"]
        assert all(torch.equal(s0[k], s1[k]) for k in s0), "the skipped step moved nothing"
        assert any(not torch.equal(s1[k], s2[k]) for k in s1), "the next step trains again"
    assert "0.weight" in first["states"][0] and "3.w" in last["states"][0]


def test_pipeline_schedule_that_cannot_run_is_refused_by_key():
    cfg = {
        **harness.QUIET,
        "mesh": {"pp": 1},
        "pipeline": {"virtual_stages": 2},
    }
    with pytest.raises(ConfigError, match=r"pipeline\.virtual_stages"):
        longboat.initialize(
            reference.chain_net(),
            None,
            {**cfg, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
        )


# -- checkpoints: layers as pieces with stage-independent names --------------------------------


def _checkpoint(cfg: dict[str, Any], directory: str, save_after: int) -> dict[str, Any]:
    """Train ``save_after`` steps and save, or (0) load the latest checkpoint; what this rank
    then holds."""
    recipe = reference.Recipe(model="chain", optimizer="adamw", clip=0.5)
    model, opt, _ = recipe.build()
    engine = longboat.initialize(model, opt, cfg)
    if save_after:
        data = harness.data_for(recipe, engine.batch.train_batch_size * save_after)
        for batch in engine.loader(data, per_step=True):
            engine.train_step(
                batch,
                lambda out, mb: nn.functional.cross_entropy(out, mb[2]),
                inputs=lambda mb: (mb[1],),
            )
            if engine.global_step == save_after:
                break
    return _save_or_load(engine, directory, save_after)


def _save_or_load(engine: longboat.Engine, directory: str, save_after: int) -> dict[str, Any]:
    """Save after training (``save_after`` > 0) or load; what this rank then holds."""
    if save_after:
        engine.save_checkpoint(directory)
    else:
        engine.load_checkpoint(directory)
    out = {
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
        "step": engine.global_step,
    }
    engine.close()
    return out


def _whole(results: list[dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    state: dict[str, torch.Tensor] = {}
    for r in results:
        state.update(r["state"])
    return state, harness.assemble(results)


@pytest.mark.parametrize(
    ("save", "load"),
    [
        ((2, {"mesh": {"pp": 2}}), (1, {})),
        ((2, {"mesh": {"pp": 2}}), (4, {"mesh": {"pp": 4}})),
        ((1, {}), (4, {"mesh": {"pp": 2}, "strategy": "zero", "zero": {"stage": 2}})),
    ],
    ids=["pp2-to-single", "pp2-to-pp4", "single-to-pp2xzero2"],
)
def test_pipeline_checkpoints_reshard(ranks, tmp_path, save, load):
    def cfg(world: int, extra: dict[str, Any]) -> dict[str, Any]:
        pp = extra.get("mesh", {}).get("pp", 1)
        micro = GLOBAL_BATCH // (world // pp * 4)
        return harness.config(
            {k: extra[k] for k in ("strategy", "zero") if k in extra},
            reference.Recipe(model="chain"),
            GLOBAL_BATCH,
            micro,
            **{k: v for k, v in extra.items() if k not in ("strategy", "zero")},
        )

    saved = ranks(save[0], _checkpoint, cfg(*save), str(tmp_path), 3)
    loaded = ranks(load[0], _checkpoint, cfg(*load), str(tmp_path), 0)
    assert {r["step"] for r in loaded} == {3}
    want_state, want_optim = _whole(saved)
    got_state, got_optim = _whole(loaded)
    assert reference.max_rel_diff(got_state, want_state) == 0.0
    assert got_optim.keys() == want_optim.keys()
    for name, st in want_optim.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(got_optim[name][k], v), (name, k)
            else:
                assert got_optim[name][k] == v, (name, k)
    fresh = reference.Recipe(model="chain").build()[0]  # what loading must have replaced
    assert any(not torch.equal(fresh.state_dict()[k], v) for k, v in got_state.items())


# -- a model that lists its own layers ----------------------------------------------------------


def _small_gpt(tie: bool = False) -> nn.Module:
    from longboat.models import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=3, n_heads=2, seq_len=8, tie_weights=tie)


def _gpt_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from longboat.models import synthetic_tokens

    g = torch.Generator().manual_seed(3)
    return [synthetic_tokens(batch, 8, 64, g) for _ in range(steps)]


def _gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _train_gpt(cfg: dict[str, Any], steps: int, tie: bool = False) -> dict[str, Any]:
    model = _small_gpt(tie)
    names = [n for n, _ in model.named_parameters()]
    example = _gpt_batches(1, 2)[0][0]  # the default partition times the layers on it
    engine = longboat.initialize(model, None, cfg, example_input=example)
    dp = engine.topology.data("dp")  # each data-parallel rank its slice of the step's samples
    losses = [
        engine.train_step(
            tuple(t.chunk(dp.world_size)[dp.rank] for t in b),
            lambda out, mb: _gpt_loss(out, mb[1]),
        )
        for b in _gpt_batches(steps, 8)
    ]
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    held = [n for n, _ in engine.module.named_parameters()]
    engine.close()
    return {"losses": losses, "state": state, "names": names, "held": held}


def _plain_gpt(steps: int, micro: int, tie: bool = False) -> tuple[list[float], nn.Module]:
    """The plain loop: the whole model, micro-batches of ``micro``, loss averaged over them."""
    model = _small_gpt(tie)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = []
    for x, y in _gpt_batches(steps, 8):
        opt.zero_grad(set_to_none=True)
        total, n = 0.0, 8 // micro
        for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
            loss = _gpt_loss(model(xm), ym)
            (loss / n).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        plain.append(total / n)
    return plain, model


def test_a_model_listing_its_layers_keeps_its_names_in_stages(ranks):
    cfg = {
        **harness.QUIET,
        "mesh": {"pp": 2},
        "gradient_clipping": 1.0,
        "batch": {"train_batch_size": 8, "gradient_accumulation_steps": 4},
        # SGD: Adam would turn the rounding noise of gradients that are zero in exact
        # arithmetic (a key bias: softmax ignores it) into steps of the full learning rate
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    }
    results = ranks(2, _train_gpt, cfg, 4)
    # the plain loop: the whole model, micro-batches of 2, loss averaged over them
    model = _small_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = []
    for x, y in _gpt_batches(4, 8):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.split(2), y.split(2), strict=True):
            loss = _gpt_loss(model(xm), ym)
            (loss / 4).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        plain.append(total / 4)
    for r in results:
        assert r["losses"] == pytest.approx(plain, rel=1e-5)
    state = {**results[0]["state"], **results[1]["state"]}
    assert not set(results[0]["state"]) & set(results[1]["state"]), "each stage its own layers"
    assert reference.max_rel_diff(state, model.state_dict()) <= 1e-5  # the user's own names


@pytest.mark.parametrize(
    ("world", "extra"),
    [
        (2, {"mesh": {"pp": 2}}),  # embedding on stage 0, head on stage 1
        (4, {"mesh": {"pp": 4}}),  # stages 0 and 3 hold it, 1 and 2 do not
        (4, {"mesh": {"pp": 2}, "strategy": "zero", "zero": {"stage": 2}}),  # sharded over dp
        (4, {"mesh": {"pp": 2}, "strategy": "zero", "zero": {"stage": 3}}),
        (4, {"mesh": {"pp": 2}, "strategy": "replicate"}),
    ],
)
def test_a_weight_tied_across_stages_equals_plain_pytorch(ranks, world, extra):
    # [Note: tied weights]: the GPT's embedding and head share one weight, on two stages
    stages = extra["mesh"]["pp"]
    cfg = {
        **harness.QUIET,
        "gradient_clipping": 1.0,  # the norm counts the tied weight once
        "batch": {"train_batch_size": 8, "gradient_accumulation_steps": 4},
        "pipeline": {"partition": "uniform"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        **extra,
    }
    results = ranks(world, _train_gpt, cfg, 4, True)
    dp = world // stages
    plain, model = _plain_gpt(4, 8 // (4 * dp), tie=True)
    for s in range(stages):  # ranks s*dp .. s*dp+dp-1: one stage, each its own samples
        mine = [results[s * dp + d]["losses"] for d in range(dp)]
        assert [sum(x) / dp for x in zip(*mine, strict=True)] == pytest.approx(plain, rel=1e-5)
    want = model.state_dict()
    holders = [r for r in results if "tok_emb.weight" in r["held"]]
    # held under the whole model's name by the first stage and the last (and their dp ranks)
    assert len(holders) == 2 * dp and "head.weight" not in holders[-1]["held"]
    for r in results:
        got = {k: v for k, v in r["state"].items() if not k.endswith(("attn.mask", "bias_mask"))}
        mine = {k: want[k] for k in got if k in r["held"] or k.endswith("head.weight")}
        assert reference.max_rel_diff({k: got[k] for k in mine}, mine) <= 1e-5


def _tied_checkpoint(cfg: dict[str, Any], directory: str, save_after: int) -> dict[str, Any]:
    """The tied GPT: train ``save_after`` steps and save, or (0) load; what this rank holds."""
    model = _small_gpt(tie=True)
    engine = longboat.initialize(model, None, cfg)
    dp = engine.topology.data("dp")
    for b in _gpt_batches(save_after, 8):
        engine.train_step(
            tuple(t.chunk(dp.world_size)[dp.rank] for t in b),
            lambda out, mb: _gpt_loss(out, mb[1]),
        )
    return _save_or_load(engine, directory, save_after)


@pytest.mark.parametrize(
    ("world", "extra"),
    [(1, {}), (4, {"mesh": {"pp": 2}, "strategy": "zero", "zero": {"stage": 2}})],
    ids=["to-single", "to-pp2xzero2"],
)
def test_a_checkpoint_with_a_tied_weight_reshards(ranks, tmp_path, world, extra):
    base = {
        **harness.QUIET,
        "batch": {"train_batch_size": 8, "gradient_accumulation_steps": 4},
        "pipeline": {"partition": "uniform"},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
    }
    saved = ranks(2, _tied_checkpoint, {**base, "mesh": {"pp": 2}}, str(tmp_path), 2)
    # both stages hold the tied weight; the checkpoint has it once
    manifest = json.loads((tmp_path / "step-00000002" / "manifest.json").read_text())
    for key in ("model", "optim.momentum_buffer"):
        assert len(manifest["tensors"]["tok_emb.weight"][key]["shards"]) == 1, key
    loaded = ranks(world, _tied_checkpoint, {**base, **extra}, str(tmp_path), 0)
    want_state, want_optim = _whole(saved)
    got_state, got_optim = _whole(loaded)
    assert {r["step"] for r in loaded} == {2}
    assert set(got_state) == set(want_state)
    assert reference.max_rel_diff(got_state, want_state) == 0
    assert got_optim.keys() == want_optim.keys() and "tok_emb.weight" in got_optim
    for name, st in want_optim.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert torch.equal(got_optim[name][k], v), (name, k)


def _tied_specs() -> PipelineModule:
    return PipelineModule(
        [
            TiedLayerSpec("embed", nn.Embedding, 16, 8),
            LayerSpec(nn.Linear, 8, 8),
            torch.tanh,
            LayerSpec(nn.Linear, 8, 8),
            TiedLayerSpec("embed", nn.Embedding, 16, 8, forward_fn=lambda emb, h: h @ emb.weight.T),
        ],
        partition=[0, 2, 5],
    )


def _train_tied_specs(cfg: dict[str, Any], batches: list[Any]) -> dict[str, Any]:
    torch.manual_seed(torch.distributed.get_rank())  # each rank builds its own copies
    engine = longboat.initialize(_tied_specs(), None, cfg)
    init = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    losses = [engine.train_step(b, lambda out, mb: _gpt_loss(out, mb[1])) for b in batches]
    final = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return {"init": init, "losses": losses, "final": final}


def test_tied_layer_specs_equal_plain_pytorch(ranks):
    g = torch.Generator().manual_seed(5)
    batches = [tuple(torch.randint(0, 16, (8, 4), generator=g) for _ in "xy") for _ in range(3)]
    cfg = {
        **harness.QUIET,
        "mesh": {"pp": 2},
        "gradient_clipping": 1.0,
        "batch": {"train_batch_size": 8, "gradient_accumulation_steps": 4},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}},
    }
    first, last = ranks(2, _train_tied_specs, cfg, batches)
    # one name on both stages, and the second stage's copy started from the first's
    assert torch.equal(first["init"]["tied.embed.weight"], last["init"]["tied.embed.weight"])
    # the plain model, from the same initial values
    emb, l1, l2 = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    with torch.no_grad():
        emb.weight.copy_(first["init"]["tied.embed.weight"])
        l1.load_state_dict({k[2:]: v for k, v in first["init"].items() if k.startswith("1.")})
        l2.load_state_dict({k[2:]: v for k, v in last["init"].items() if k.startswith("3.")})
    params = [emb.weight, *l1.parameters(), *l2.parameters()]
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    plain = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(x.split(2), y.split(2), strict=True):
            logits = l2(torch.tanh(l1(emb(xm)))) @ emb.weight.T
            loss = _gpt_loss(logits, ym)
            (loss / 4).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        plain.append(total / 4)
    assert first["losses"] == pytest.approx(plain, rel=1e-5)
    for r in (first, last):
        assert torch.allclose(r["final"]["tied.embed.weight"], emb.weight, rtol=1e-5, atol=1e-6)
    assert torch.allclose(first["final"]["1.weight"], l1.weight, rtol=1e-5, atol=1e-6)
    assert torch.allclose(last["final"]["3.weight"], l2.weight, rtol=1e-5, atol=1e-6)


def test_a_module_of_specs_trains_without_stages():
    torch.manual_seed(0)
    engine = longboat.initialize(
        _tied_specs(),
        None,
        {
            **harness.QUIET,
            "batch": {"micro_batch_size": 4},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    x = torch.randint(0, 16, (4, 4))
    engine.train_step((x, x), lambda out, mb: _gpt_loss(out, mb[1]))
    names = [n for n, _ in engine.module.named_parameters()]
    engine.close()
    assert names == ["tied.embed.weight", "1.weight", "1.bias", "3.weight", "3.bias"]


def test_ties_are_found_and_named_on_every_stage_that_holds_them():
    from longboat.pipeline import layered

    model = _small_gpt(tie=True)
    w = model.tok_emb.weight
    bounds = layered.boundaries(model, 2, "uniform")
    _, tied = layered.split(model, bounds, [1])
    ((tie, param),) = tied
    assert (tie.name, tie.stages) == ("tok_emb.weight", (0, 1)) and param is w
    assert next(n for n, p in model.named_parameters() if p is w) == "tok_emb.weight"
    # a PipelineModule whose first and last layers share a module
    shared = nn.Linear(4, 4)
    pm = PipelineModule([shared, nn.Tanh(), nn.Linear(4, 4), shared], partition=[0, 2, 4])
    tied = pm.bind([0, 2, 4], [1])
    assert [(t.name, t.stages) for t, _ in tied] == [("0.weight", (0, 1)), ("0.bias", (0, 1))]
    assert [n for n, _ in pm.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]


# -- a stage that stops ------------------------------------------------------------------------


def test_a_stopped_stage_is_named_by_its_neighbour(tmp_path):
    timeout_s = 3.0
    logs = tmp_path / "logs"
    proc = test_launcher._run(
        test_launcher._cli(
            "run",
            "-n",
            "2",
            "--log-dir",
            str(logs),
            str(test_launcher.SCRIPTS / "pipeline_stop.py"),
            str(timeout_s),
            str(tmp_path),
        )
    )
    err = proc.stderr
    assert proc.returncode != 0, err
    path = logs / "hang_reports" / "rank1.json"
    rep = json.loads(path.read_text())
    assert rep["kind"] == "timeout" and rep["not_arrived"] == [0], rep
    assert rep["collective"]["op"] == "recv", rep
    assert "activation of micro-batch 0 from stage 0, from rank 0" in rep["collective"]["tag"], rep
    entered = float((tmp_path / "entered1").read_text())
    assert path.stat().st_mtime - entered <= timeout_s + 1.0
    assert "[rank1]: longboat: collective timed out after 3 s on rank 1 of 2" in proc.stdout + err
    time.sleep(0.2)
    for r in (0, 1):
        pid = int((tmp_path / f"pid{r}").read_text())
        assert not test_launcher._alive(pid), f"rank {r} still runs"
