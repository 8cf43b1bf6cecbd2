"""Every strategy against the plain PyTorch loop of ``reference.py`` (which imports nothing from
longboat), at 1, 2 and 4 ranks: every micro-batch's loss on every rank, then parameters, buffers,
optimizer state and the learning rate, on a model with conditionally used, never-used, frozen
and tied parameters, BatchNorm and an LSTM, with accumulation, clipping, weight decay and a
scheduler."""

from __future__ import annotations

import ast
from pathlib import Path

import harness
import pytest
import reference
import torch

from longboat.comm.desync import DesyncError
from longboat.testing import RankFailure

STEPS = 10
GLOBAL_BATCH = 16
TOL = 1e-5  # fp32, relative

STRATEGIES = harness.ZOO_STRATEGIES

RECIPES = {
    # AdamW with weight decay moves any parameter it steps, used or not; clipping and the
    # schedule must see the same gradients; accumulation over two micro-batches.
    "adamw-clip-sched": reference.Recipe(model="zoo", optimizer="adamw", clip=1.0, scheduler=True),
    # SGD with momentum, no clipping: replicate steps the optimizer bucket by bucket.
    "sgd-momentum": reference.Recipe(model="zoo", optimizer="sgd"),
}

EXPERT = "moe.experts.2.weight"  # the rare expert


def _cases():
    yield "single", 1
    for name in STRATEGIES:
        for world in (1, 2, 4):
            yield name, world


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize(("strategy", "world"), list(_cases()))
def test_strategy_equals_plain_pytorch(ranks, strategy, world, recipe):
    cfg = {"strategy": "single"} if strategy == "single" else STRATEGIES[strategy]
    results, plain = harness.run_and_compare(
        ranks, world, cfg, RECIPES[recipe], STEPS, accum=2, global_batch=GLOBAL_BATCH, tol=TOL
    )
    for r, res in enumerate(results):  # every rank holds the same parameters and buffers
        for k, v in res["state"].items():
            assert torch.equal(v, results[0]["state"][k]), f"rank {r} differs at {k}"
    if strategy == "replicate" and world > 1 and RECIPES[recipe].clip == 0:
        assert all(res["overlapped"] == STEPS for res in results), "the overlap path ran"
    _assert_coverage(plain, world)


def _assert_coverage(plain: reference.PlainRun, world: int) -> None:
    """The run met the cases that hide data-parallel mistakes (so a data change cannot quietly
    make the test weaker)."""
    steps = plain.used
    used = [[[EXPERT in u for u in micro] for micro in step] for step in steps]
    # Used on the first micro-batch of a step on some rank, but not on that rank's last.
    assert any(m[0][r] and not m[-1][r] for m in used for r in range(world))
    # Used by no rank in a whole step: it must not move.
    assert any(not any(map(any, m)) for m in used)
    if world > 1:  # used by some ranks and not others within one micro-batch
        assert any(any(x) and not all(x) for m in used for x in m)
    # Never used, frozen: never a gradient.
    assert all(
        "never" not in u and "frozen.weight" not in u
        for step in steps
        for micro in step
        for u in micro
    )


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_tiny_and_tied_models_at_four_ranks(ranks, strategy):
    """The earlier models too: TinyNet (LayerNorm, frozen layer) with Adam and TiedNet (a weight
    shared by two modules, odd sizes) with clipping."""
    cfg = STRATEGIES[strategy]
    if strategy == "zero3":
        cfg = {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear"]}}
    for recipe in (
        reference.Recipe(model="tiny", optimizer="adam"),
        reference.Recipe(model="tied", optimizer="adamw", clip=0.5),
    ):
        harness.run_and_compare(
            ranks, 4, cfg, recipe, STEPS, accum=1, global_batch=GLOBAL_BATCH, tol=TOL
        )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_equals_plain_pytorch(ranks, stage):
    """ZeRO within pairs of ranks, replicated across the two pairs ([Note: hybrid sharding]):
    the same run as the plain loop at 4 ranks, every micro-batch's loss included."""
    harness.run_and_compare(
        ranks,
        4,
        STRATEGIES[f"zero{stage}"],
        RECIPES["adamw-clip-sched"],
        STEPS,
        accum=2,
        global_batch=GLOBAL_BATCH,
        tol=TOL,
        mesh={"dp_replicate": 2},
    )


def test_reference_is_plain():
    """The reference imports nothing from longboat, directly or through a test module."""
    here = Path(__file__).parent
    todo, seen = ["reference"], set()
    while todo:
        mod = todo.pop()
        seen.add(mod)
        tree = ast.parse((here / f"{mod}.py").read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                top = name.split(".")[0]
                assert top != "longboat", f"{mod}.py imports {name}"
                if (here / f"{top}.py").exists() and top not in seen:
                    todo.append(top)


# -- evaluation on one rank --------------------------------------------------------------------


def _evaluate_alone(cfg: dict) -> dict:
    recipe = reference.Recipe(model="zoo")
    cfg = harness.config(cfg, recipe, GLOBAL_BATCH, GLOBAL_BATCH // 2)
    model, opt, _ = recipe.build()
    import longboat

    engine = longboat.initialize(model, opt, cfg)
    data = harness.data_for(recipe, GLOBAL_BATCH * 4)
    batches = iter(engine.loader(data))
    for _ in range(2):
        _, *batch = next(batches)
        engine.backward(reference.forward_loss(engine, batch))
        engine.step()
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    _, x, route, _ = data[:8]
    out = {}
    with engine.gathered_parameters():  # collective; a no-op except under ZeRO-3
        if torch.distributed.get_rank() == 0:
            with torch.no_grad():  # training mode, no gradients: no buffer broadcast
                out["no_grad"] = engine(x, route)
            engine.eval()  # eval mode, gradients on
            out["eval"] = engine(x, route).detach()
            engine.train()
    # Training goes on in step on every rank afterwards (nothing was left half-issued).
    _, *batch = next(batches)
    engine.backward(reference.forward_loss(engine, batch))
    engine.step()
    after = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return {"state": state, "out": out, "after": after}


@pytest.mark.parametrize("strategy", ["single", *STRATEGIES])
def test_rank_zero_evaluates_alone(ranks, strategy):
    cfg = {"strategy": "single"} if strategy == "single" else STRATEGIES[strategy]
    world = 1 if strategy == "single" else 2
    results = ranks(world, _evaluate_alone, cfg, timeout=60)
    model = reference.ZooNet()
    model.load_state_dict(results[0]["state"])
    data = reference.zoo_dataset(GLOBAL_BATCH * 4)
    _, x, route, _ = data[:8]
    with torch.no_grad():
        want_train = model(x, route)  # training mode: batch statistics
        model.eval()
        want_eval = model(x, route)  # eval mode: running statistics (rank 0's)
    torch.testing.assert_close(results[0]["out"]["no_grad"], want_train)
    torch.testing.assert_close(results[0]["out"]["eval"], want_eval)
    for r, res in enumerate(results):
        assert res["out"] == {} or r == 0
        for k, v in res["after"].items():
            assert torch.equal(v, results[0]["after"][k]), f"rank {r} differs at {k}"


# -- ZeRO-3 units that run on some ranks only ------------------------------------------------


def _experts_as_units() -> None:
    recipe = reference.Recipe(model="zoo")
    cfg = harness.config(
        {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear"]}},
        recipe,
        GLOBAL_BATCH,
        GLOBAL_BATCH // 2,
    )
    harness.train(recipe, cfg, STEPS)


def test_zero3_units_that_run_on_some_ranks_only_are_an_error(ranks):
    """Each expert as its own stage-3 unit: a rank that routes no sample to an expert does not
    gather it, so the ranks' gathers go out of step. That must be an error naming the units on
    every rank (the desync check is on by default), never a silent mix of two units' shards."""
    with pytest.raises(RankFailure) as info:
        ranks(2, _experts_as_units, timeout=60)
    text = str(info.value)
    assert DesyncError.__name__ in text and "[unit " in text, text[-3000:]  # units are named
    for rank in (0, 1):
        assert f"rank {rank}" in text


def _routed_to_different_experts() -> None:
    import longboat

    torch.manual_seed(0)
    model = reference.Experts(4, 2)
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            "strategy": "zero",
            "zero": {"stage": 3, "unit_classes": ["Linear"]},
            "batch": {"micro_batch_size": 2},
            "log": {"progress": False, "level": "WARNING"},
        },
    )
    rank = torch.distributed.get_rank()
    engine(torch.randn(2, 4), torch.full((2,), rank))  # rank r runs expert r only


def test_zero3_same_shaped_units_out_of_step_are_told_apart(ranks):
    """Rank 0 gathers expert 0 while rank 1 gathers expert 1: the same operation, dtype and
    shape. Without the unit in the fingerprint, each rank would silently receive half of the
    other expert."""
    with pytest.raises(RankFailure) as info:
        ranks(2, _routed_to_different_experts, timeout=60)
    text = str(info.value)
    assert "different tensors of the same shape" in text, text[-3000:]
    assert ": experts.0]" in text and ": experts.1]" in text, text[-3000:]  # both tags


# -- what the optimizer trains is what the model has ------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "replicate", "zero"])
def test_optimizer_and_model_must_agree(strategy):
    """A trainable parameter the optimizer does not hold, or a tensor in the optimizer that the
    model does not have, is refused at initialize with its name, before anything trains."""
    import longboat

    cfg = {"strategy": strategy, "batch": {"micro_batch_size": 2}, "log": {"progress": False}}
    model = reference.TinyNet()
    left_out = [p for n, p in model.named_parameters() if n != "mid.weight"]
    with pytest.raises(longboat.ConfigError, match=r"'mid\.weight'.*requires_grad_\(False\)"):
        longboat.initialize(model, torch.optim.AdamW(left_out), cfg)
    stranger = torch.nn.Parameter(torch.zeros(3, 5))
    with pytest.raises(longboat.ConfigError, match=r"not parameters of the model.*\(3, 5\)"):
        longboat.initialize(model, torch.optim.AdamW([*model.parameters(), stranger]), cfg)
    # Frozen parameters may sit in the optimizer (built before freezing): plain PyTorch skips them.
    longboat.initialize(model, torch.optim.AdamW(model.parameters()), cfg).close()


# -- schedule-driven steps ----------------------------------------------------------------------


def _by_steps(cfg: dict, recipe: reference.Recipe) -> dict:
    """The same run as harness.train, through engine.train_step on whole-step batches."""
    import longboat

    model, opt, sched = recipe.build()
    engine = longboat.initialize(model, opt, cfg, scheduler=sched)
    data = harness.data_for(recipe, engine.batch.train_batch_size * STEPS)
    losses = []
    for ids, *batch in engine.loader(data, per_step=True):
        losses.append(
            engine.train_step(
                tuple(batch),
                lambda out, mb: torch.nn.functional.cross_entropy(out.float(), mb[-1]),
                inputs=lambda mb: tuple(mb[:-1]),
            )
        )
        assert len(ids) == engine.batch.micro_batch_size * engine.accumulation_steps
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return {"state": state, "losses": losses}


@pytest.mark.parametrize("strategy", ["replicate", "zero2", "zero3"])
def test_train_step_is_the_same_step(ranks, strategy):
    """engine.train_step(batch, loss_fn) on a whole step's samples computes exactly what
    engine(x) / backward / step does on its micro-batches, bit for bit."""
    recipe = RECIPES["adamw-clip-sched"]
    cfg = harness.config(STRATEGIES[strategy], recipe, GLOBAL_BATCH, GLOBAL_BATCH // 4)
    by_micro = ranks(2, harness.train, recipe, cfg, STEPS, perturb=False)
    by_step = ranks(2, _by_steps, cfg, recipe)
    for micro, step in zip(by_micro, by_step, strict=True):
        assert [sum(s) / len(s) for s in micro["losses"]] == step["losses"]
        for k, v in micro["state"].items():
            assert torch.equal(v, step["state"][k]), k
