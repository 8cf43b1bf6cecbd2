"""ZeRO stages 1-3 against the plain PyTorch loop of ``reference.py``: every micro-batch's loss,
parameters and optimizer state after 10 steps; and what makes it ZeRO (sharded state, names
kept, the communication dtype, the optimizers it accepts)."""

from __future__ import annotations

import dp_helpers
import harness
import pytest
import reference
import torch

import longboat

# Small buckets and per-module units give many units whose sizes do not divide the world size.
UNITS = {
    1: {"bucket_mb": 0.001},
    2: {"bucket_mb": 0.001},
    3: {"unit_classes": ["Linear", "LayerNorm"]},
}


def _zero(stage: int, **units) -> dict:
    return {"strategy": "zero", "zero": {"stage": stage, **(units or UNITS[stage])}}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    ("accum", "clip", "optimizer"),
    [
        (1, 0.0, "sgd"),  # a sum instead of a mean would show with SGD
        (2, 0.5, "adamw"),  # accumulation, clipping by the norm summed over shards, AdamW
    ],
)
def test_zero_equals_plain_pytorch(ranks, stage, world, accum, clip, optimizer):
    recipe = reference.Recipe(model="tiny", optimizer=optimizer, clip=clip)
    dp_helpers.equals_plain_pytorch(ranks, world, _zero(stage), recipe, accum)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_tied_parameters_and_odd_sizes(ranks, stage):
    # stage 3: proj and head are different units sharing a weight
    units = {"unit_classes": ["Linear"]} if stage == 3 else {}
    recipe = reference.Recipe(model="tied", optimizer="adamw", clip=0.5)
    dp_helpers.equals_plain_pytorch(ranks, 4, _zero(stage, **units), recipe, 1)


def test_zero3_default_units_by_size(ranks):
    recipe = reference.Recipe(model="tiny", optimizer="adamw")
    dp_helpers.equals_plain_pytorch(ranks, 2, _zero(3, unit_min_params=300), recipe, 1)


def _shard_sizes(stage):
    cfg = {"strategy": "zero", "zero": {"stage": stage}, "batch": {"micro_batch_size": 4}}
    model, opt, engine = dp_helpers.tiny_engine(cfg, torch.optim.AdamW, lr=1e-3)
    x, y = reference.dataset(4)[:]
    dp_helpers.backward(engine, x, y)
    engine.step()
    sizes = [p.numel() for g in opt.param_groups for p in g["params"]]
    states = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim())
    names = [n for n, _ in model.named_parameters()]
    engine.close()
    return sizes, states, names


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_state_is_sharded_and_names_stay(ranks, stage):
    trainable = sum(p.numel() for p in reference.TinyNet().parameters() if p.requires_grad)
    results = ranks(2, _shard_sizes, stage)
    # The optimizer holds one piece per parameter a rank's shard overlaps: the two ranks'
    # pieces cover every trainable element once, padding not included.
    assert sum(sum(sizes) for sizes, _, _ in results) == trainable
    for sizes, states, names in results:
        assert states == 2 * sum(sizes)  # exp_avg and exp_avg_sq over the pieces only
        assert names == [n for n, _ in reference.TinyNet().named_parameters()]


def _wire_dtypes(stage):
    cfg = {
        "strategy": "zero",
        "zero": {"stage": stage},
        "precision": {"communication_data_type": "bf16"},
        "batch": {"micro_batch_size": 8},
    }
    _, _, engine = dp_helpers.tiny_engine(cfg, lr=0.1)
    seen = []
    real = engine.comm.reduce_scatter
    engine.comm.reduce_scatter = lambda out, inp, **k: seen.append(inp.dtype) or real(out, inp, **k)
    x, y = dp_helpers.rank_batch(8, 2)
    dp_helpers.backward(engine, x, y)
    engine.step()
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return seen, state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_travel_in_the_communication_dtype(ranks, stage):
    (seen, state), _ = ranks(2, _wire_dtypes, stage)
    assert seen and set(seen) == {torch.bfloat16}
    model = dp_helpers.plain_backward(16)
    updates = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.grad is not None:
                updates[n] = 0.1 * p.grad
                p -= updates[n]
    # bf16 keeps 8 significant bits: each averaged gradient is off by at most a few 2^-8
    # relative to the largest in its tensor (rounded before and after the sum), and so is the
    # update lr x grad. Anything else (a sum instead of a mean, a lost shard) is far larger.
    for k, v in model.state_dict().items():
        bound = 4 * 2**-8 * updates[k].abs().max() if k in updates else 0.0
        assert (state[k] - v).abs().max() <= bound + 1e-7, k
    assert state.keys() == model.state_dict().keys()


class _AdamWWithGlobalStep(torch.optim.AdamW):
    """A subclass may add logic across tensors: not element-wise by inheritance."""


class _DeclaredSGD(torch.optim.SGD):
    longboat_elementwise = True  # its author vouches that it stays element-wise


def _initialize(opt_cls, **kwargs):
    model = reference.TinyNet()
    opt = opt_cls(model.parameters(), **kwargs)
    return longboat.initialize(
        model,
        opt,
        {"strategy": "zero", "batch": {"micro_batch_size": 2}, "log": {"progress": False}},
    )


@pytest.mark.parametrize(
    "opt_cls", [torch.optim.LBFGS, torch.optim.Adafactor, _AdamWWithGlobalStep]
)
def test_optimizers_that_may_couple_elements_are_refused(opt_cls):
    with pytest.raises(longboat.ConfigError, match=opt_cls.__name__):
        _initialize(opt_cls)


def test_an_optimizer_may_declare_itself_elementwise():
    _initialize(_DeclaredSGD, lr=0.1).close()


class _CountedAdamW(torch.optim.AdamW):
    """AdamW that counts its ``step()`` calls (declared element-wise, as AdamW is)."""

    longboat_elementwise = True
    calls = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        return super().step(closure)


def _steps_and_gathers(stage: int, param_dtype: str | None) -> dict:
    """Three steps of the tiny model in many units: ``step()`` calls and all-gathers per step,
    and the parameters after them."""
    recipe = reference.Recipe(model="tiny", optimizer="adamw")
    model, _, _ = recipe.build()
    opt = _CountedAdamW(model.parameters(), lr=1e-2)
    extra = {"precision": {"dtype": "bf16", "param_dtype": param_dtype}} if param_dtype else {}
    world = torch.distributed.get_world_size()
    cfg = harness.config(_zero(stage), recipe, 4 * world, 4, **extra)  # no accumulation
    engine = longboat.initialize(model, opt, cfg)
    _CountedAdamW.calls = 0
    gathers = [0]
    comm = engine.strategy.comm  # the shard group's doorway
    all_gather = comm.all_gather

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        gathers[0] += 1
        return all_gather(*args, **kwargs)

    comm.all_gather = counted
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(engine.topology.rank))
    for _ in range(3):
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    out = {
        "calls": _CountedAdamW.calls / 3,
        "gathers": gathers[0] / 3,
        "units": len(engine.strategy.units),
        "params": {k: v.float() for k, v in engine.state_dict().items()},
    }
    engine.close()
    return out


@pytest.mark.parametrize("param_dtype", [None, "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
def test_a_shard_group_of_one_steps_once_and_gathers_nothing(ranks, stage, param_dtype):
    # [Note: a shard group of one] in zero/step.py: unit by unit only where a gather follows.
    (alone,) = ranks(1, _steps_and_gathers, stage, param_dtype)
    assert alone["units"] > 2, alone["units"]
    assert alone["calls"] == 1 and alone["gathers"] == 0, alone
    pair = ranks(2, _steps_and_gathers, stage, param_dtype)
    assert pair[0]["calls"] == pair[0]["units"] and pair[0]["gathers"] == pair[0]["units"]
    # the masters reached the parameters the forward reads, under param_dtype too
    ref = reference.Recipe(model="tiny", optimizer="adamw").build()[0].state_dict()
    assert any(not torch.equal(alone["params"][k], v.float()) for k, v in ref.items())


def _load_state_dict(stage: int) -> dict:
    """Train one step, then load doubled whole weights: what the engine then holds, and
    whether the optimizer state moved."""
    recipe = reference.Recipe(model="tiny", optimizer="adamw")
    model, opt, _ = recipe.build()
    engine = longboat.initialize(model, opt, harness.config(_zero(stage), recipe, 8, 4))
    x = torch.randn(4, 12)
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    before = harness.optimizer_pieces(engine)
    doubled = {k: v * 2 for k, v in engine.state_dict().items()}
    engine.load_state_dict(doubled)
    out = {
        "diff": reference.max_rel_diff(engine.state_dict(), doubled),
        "optim_kept": all(
            torch.equal(a[5], b[5])
            for a, b in zip(
                before["pieces"], harness.optimizer_pieces(engine)["pieces"], strict=True
            )
        ),
    }
    engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_load_state_dict_fills_each_ranks_share(ranks, stage):
    # Stage 3 holds shards between steps: whole tensors are cut to them, not copied whole.
    for r in ranks(2, _load_state_dict, stage):
        assert r["diff"] == 0.0 and r["optim_kept"]
