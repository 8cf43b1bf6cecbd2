"""ZeRO stages 1-3 against single: same seed, same global batch, same parameters after 10 steps."""

from __future__ import annotations

import pytest
import reference
import torch

STEPS = 10
GLOBAL_BATCH = 16


def _cfg(strategy: str, micro: int, clip: float, **zero) -> dict:
    return {"strategy": strategy, "gradient_clipping": clip,
            "batch": {"train_batch_size": GLOBAL_BATCH, "micro_batch_size": micro},
            "zero": zero}


def _run(micro, clip, optimizer, model_name, zero):
    return reference.train(_cfg("zero", micro, clip, **zero), STEPS, optimizer,
                           model_name=model_name)


def _reference(clip, optimizer, model_name):
    return reference.train(_cfg("single", GLOBAL_BATCH, clip), STEPS, optimizer,
                           model_name=model_name)


def _check(results, ref):
    for r, state in enumerate(results):
        assert state.keys() == ref.keys()
        diff = reference.max_rel_diff(state, ref)
        assert diff < 1e-5, f"rank {r}: max relative difference {diff:.3g} vs single"


# Small buckets and per-module units give many units whose sizes do not divide the world size.
UNITS = {1: {"bucket_mb": 0.001}, 2: {"bucket_mb": 0.001},
         3: {"unit_classes": ["Linear", "LayerNorm"]}}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(("accum", "clip", "optimizer"), [
    (1, 0.0, "sgd"),     # a sum instead of a mean would show with SGD
    (2, 0.5, "adamw"),   # accumulation, clipping by the norm summed over shards, AdamW
])
def test_zero_matches_single(ranks, stage, world, accum, clip, optimizer):
    micro = GLOBAL_BATCH // (world * accum)
    results = ranks(world, _run, micro, clip, optimizer, "tiny", {"stage": stage, **UNITS[stage]})
    _check(results, _reference(clip, optimizer, "tiny"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_tied_parameters_and_odd_sizes(ranks, stage):
    zero = {"stage": stage, **UNITS[stage]}
    if stage == 3:
        zero["unit_classes"] = ["Linear"]  # proj and head are different units sharing a weight
    results = ranks(4, _run, 4, 0.5, "adamw", "tied", zero)
    _check(results, _reference(0.5, "adamw", "tied"))


def test_zero3_default_units_by_size(ranks):
    results = ranks(2, _run, 8, 0.0, "adamw", "tiny", {"stage": 3, "unit_min_params": 300})
    _check(results, _reference(0.0, "adamw", "tiny"))


def _shard_sizes(stage):
    import longboat

    torch.manual_seed(0)
    model = reference.TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = longboat.initialize(model, opt, {
        "strategy": "zero", "zero": {"stage": stage}, "batch": {"micro_batch_size": 4},
        "log": {"progress": False, "level": "WARNING"}})
    x, y = reference.dataset(4)[:]
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()
    sizes = [p.numel() for g in opt.param_groups for p in g["params"]]
    states = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim())
    names = [n for n, _ in model.named_parameters()]
    engine.close()
    return sizes, states, names


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_state_is_sharded_and_names_stay(ranks, stage):
    trainable = sum(p.numel() for p in reference.TinyNet().parameters() if p.requires_grad)
    (sizes, states, names), _ = ranks(2, _shard_sizes, stage)
    # Two ranks' shards cover every parameter, with less than one element of padding per unit.
    assert trainable <= sum(sizes) * 2 < trainable + 2 * len(sizes)
    assert states == 2 * sum(sizes)  # exp_avg and exp_avg_sq over the shard only
    assert names == [n for n, _ in reference.TinyNet().named_parameters()]


def _wire_dtypes(stage):
    import longboat

    torch.manual_seed(0)
    model = reference.TinyNet()
    engine = longboat.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), {
        "strategy": "zero", "zero": {"stage": stage},
        "precision": {"communication_data_type": "bf16"}, "batch": {"micro_batch_size": 8},
        "log": {"progress": False, "level": "WARNING"}})
    seen = []
    real = engine.comm.reduce_scatter
    engine.comm.reduce_scatter = lambda out, inp, **k: seen.append(inp.dtype) or real(
        out, inp, **k)
    x, y = reference.dataset(8 * 2)[torch.distributed.get_rank()::2]
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.close()
    return seen, state


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_travel_in_the_communication_dtype(ranks, stage):
    (seen, state), _ = ranks(2, _wire_dtypes, stage)
    assert seen and set(seen) == {torch.bfloat16}
    torch.manual_seed(0)
    model = reference.TinyNet()
    x, y = reference.dataset(16)[:]
    torch.nn.functional.cross_entropy(model(x), y).backward()
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


def test_optimizers_that_couple_elements_are_refused():
    import longboat

    model = reference.TinyNet()
    for opt in (torch.optim.LBFGS(model.parameters()), torch.optim.Adafactor(model.parameters())):
        with pytest.raises(longboat.ConfigError, match=type(opt).__name__):
            longboat.initialize(model, opt, {"strategy": "zero", "batch": {"micro_batch_size": 2},
                                             "log": {"progress": False}})
