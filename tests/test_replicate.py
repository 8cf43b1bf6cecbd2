"""replicate against the plain PyTorch loop of ``reference.py``: every micro-batch's loss, the
parameters and the optimizer state after 10 steps; and the properties that make it replicate
(averaged gradients, no communication between boundaries, the optimizer overlap)."""

from __future__ import annotations

import dp_helpers
import harness
import pytest
import reference
import torch
from dp_helpers import GLOBAL_BATCH


def _cfg(bucket_mb: float = 0.001, overlap: bool = True) -> dict:
    # A tiny bucket cap gives several buckets, so ordering and partial buckets are exercised.
    return {
        "strategy": "replicate",
        "replicate": {
            "bucket_mb": bucket_mb,
            "first_bucket_mb": bucket_mb / 4,
            "overlap_optimizer": overlap,
        },
    }


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    ("accum", "clip", "optimizer"),
    [
        (1, 0.0, "sgd"),  # plain: a sum instead of a mean would be 2x/4x off with SGD
        (2, 0.0, "sgd"),  # gradient accumulation, no sync between boundaries
        (1, 0.5, "adamw"),  # clipping by the global norm, AdamW
        (1, 0.0, "adamw"),  # optimizer overlapped with communication, bucket by bucket
        (2, 0.5, "sgd"),
    ],
)
def test_replicate_equals_plain_pytorch(ranks, world, accum, clip, optimizer):
    recipe = reference.Recipe(model="tiny", optimizer=optimizer, clip=clip)
    results, plain = dp_helpers.equals_plain_pytorch(ranks, world, _cfg(), recipe, accum)
    for r, res in enumerate(results):  # every replica holds bit-identical parameters
        for k, v in res["state"].items():
            assert torch.equal(v, results[0]["state"][k]), f"rank {r} diverged from rank 0 at {k}"
    # the run really trained: parameters moved away from their initial values
    init = reference.Recipe().build()[0].state_dict()
    assert reference.max_rel_diff(plain.state, init) > 1e-2


def _grads_after_one_backward(world: int):
    cfg = {"strategy": "replicate", "batch": {"micro_batch_size": 8}}
    model, _, engine = dp_helpers.tiny_engine(cfg, lr=0.1)
    x, y = dp_helpers.rank_batch(8, world)  # rank r takes rows r, r+world, ...
    dp_helpers.backward(engine, x, y)
    engine.strategy.finish_gradients()
    engine.strategy.wait_gradients()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    engine.close()
    return grads


@pytest.mark.parametrize("world", [2, 4])
def test_gradients_are_averaged_not_summed(ranks, world):
    got = ranks(world, _grads_after_one_backward, world)[0]
    model = dp_helpers.plain_backward(8 * world)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert not any(n.startswith("module.") for n in got), "parameter names must stay the user's"


def _no_comm_between_boundaries():
    batch = {"micro_batch_size": 4, "gradient_accumulation_steps": 3}
    _, _, engine = dp_helpers.tiny_engine({"strategy": "replicate", "batch": batch}, lr=0.1)
    calls = []
    real = engine.comm.all_reduce
    engine.comm.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    x, y = reference.dataset(4)[:]
    counts = []
    for _ in range(3):
        dp_helpers.backward(engine, x, y)
        counts.append(len(calls))
        engine.step()
    engine.close()
    return counts, len(engine.strategy.plan.buckets)


def test_accumulation_skips_sync_until_boundary(ranks):
    counts, buckets = ranks(2, _no_comm_between_boundaries)[0]
    assert counts[0] == 0 and counts[1] == 0, "no all-reduce before the boundary"
    assert counts[2] == buckets, "one all-reduce per bucket at the boundary"


def _overlap(overlap: bool, hooks: bool) -> dict:
    recipe = reference.Recipe(model="tiny", optimizer="adamw")
    cfg = harness.config(_cfg(overlap=overlap), recipe, GLOBAL_BATCH, GLOBAL_BATCH // 2)
    model, opt, _ = recipe.build()
    fired = []
    if hooks:
        opt.register_step_pre_hook(lambda *_: fired.append("pre"))
        opt.register_step_post_hook(lambda *_: fired.append("post"))
    import longboat

    engine = longboat.initialize(model, opt, cfg)
    for _, *batch in engine.loader(harness.data_for(recipe, GLOBAL_BATCH * 3)):
        engine.backward(reference.forward_loss(engine, batch))
        engine.step()
    out = {
        "state": {k: v.clone() for k, v in engine.state_dict().items()},
        "fired": fired,
        "overlapped": engine.strategy.overlapped_steps,
    }
    engine.close()
    return out


def test_optimizer_overlap_is_exact(ranks):
    """Bucket-by-bucket optimizer steps give the same parameters as one step, bit for bit, and
    the bucket-by-bucket path did run."""
    on, off = (ranks(2, _overlap, flag, False)[0] for flag in (True, False))
    assert on["overlapped"] == 3 and off["overlapped"] == 0
    for k in on["state"]:
        assert torch.equal(on["state"][k], off["state"][k]), k


def test_step_hooks_fire_once_per_step(ranks):
    """Optimizer step hooks fire once per optimizer step: with hooks registered, replicate steps
    the optimizer once (not bucket by bucket), and the result is the same."""
    hooked, plain = ranks(2, _overlap, True, True)[0], ranks(2, _overlap, True, False)[0]
    assert hooked["fired"] == ["pre", "post"] * 3
    assert hooked["overlapped"] == 0
    for k in hooked["state"]:
        assert torch.equal(hooked["state"][k], plain["state"][k]), k


@pytest.mark.parametrize(
    "used",
    [[True] * 5, [False] * 5, [True, False, False, True, False], [False, True, True, False, True]],
)
def test_usage_flags_are_written_by_fills(used: list[bool]) -> None:
    from longboat.strategies.replicate import _write_flags

    flags = torch.full((len(used),), 7.0)
    _write_flags(flags, used)
    assert flags.tolist() == [float(u) for u in used]


def test_a_bucket_launch_builds_no_host_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host tensor copied into a GPU bucket is a copy from pageable memory, which waits for
    the stream to drain once per bucket in the middle of the backward: the usage flags are
    written by fills on the bucket's device (replicate._write_flags)."""
    import sys

    import longboat

    made_here: list[str] = []
    real = torch.tensor

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        caller = sys._getframe(1).f_code.co_filename
        if caller.endswith("strategies/replicate.py"):
            made_here.append(caller)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    torch.manual_seed(0)
    model = reference.ZooNet()  # a never-used parameter, and experts that route 0 leaves out
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    cfg = {**_cfg(), "batch": {"micro_batch_size": 4}, "log": {"level": "WARNING"}}
    engine = longboat.initialize(model, opt, cfg)
    monkeypatch.setattr(torch, "tensor", recording)
    x, route, y = torch.randn(4, 3, 5), torch.zeros(4, dtype=torch.long), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        engine.backward(torch.nn.functional.cross_entropy(engine(x, route), y))
        assert engine.step()
    engine.close()
    assert made_here == []
