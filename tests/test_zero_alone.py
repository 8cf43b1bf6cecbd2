"""ZeRO-3: a forward run on one rank alone outside ``engine.gathered_parameters()`` (an
evaluation on rank 0) gathers units the other ranks never gather. It must fail on every rank
with an error that names the forward and the fix, never a raw abort, a lost peer or a hang."""

from __future__ import annotations

import harness
import pytest
import reference
import torch

from longboat.testing import RankFailure

MODELS = {
    "tiny": {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear"]}},
    "zoo": harness.ZOO_STRATEGIES["zero3"],
}


def _lone_forward(model: str, last: bool) -> None:
    import longboat

    recipe = reference.Recipe(model=model)
    cfg = harness.config(MODELS[model], recipe, 16, 8, comm={"timeout_s": 20})
    net, opt, _ = recipe.build()
    engine = longboat.initialize(net, opt, cfg)
    data = harness.data_for(recipe, 64)
    batches = iter(engine.loader(data))

    def steps(n: int) -> None:
        for _ in range(n):
            _, *batch = next(batches)
            engine.backward(reference.forward_loss(engine, batch))
            engine.step()

    steps(2)
    if torch.distributed.get_rank() == 0:
        _, *inputs, _ = data[:4]
        with torch.no_grad():
            engine(*inputs)  # outside engine.gathered_parameters()
    if not last:
        steps(2)
    engine.close()


@pytest.mark.parametrize("last", [False, True], ids=["mid_run", "end_of_run"])
@pytest.mark.parametrize("model", list(MODELS))
def test_lone_forward_fails_on_every_rank(ranks, model, last):
    with pytest.raises(RankFailure) as info:
        ranks(2, _lone_forward, model, last, timeout=60)
    text = str(info.value)
    with open(__file__) as f:
        line = next(i for i, s in enumerate(f, 1) if "engine(*inputs)" in s)
    for rank in (0, 1):
        section = text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        error = section.strip().splitlines()[-1]  # the exception's own words, not the traceback
        assert error.startswith("longboat.comm.desync.DesyncError"), section[-2000:]
        assert "engine.gathered_parameters()" in error, error
        # The call that caused it: its rank, unit (module) and line
        assert "rank 0 entered all_gather" in error, error
        assert "[unit 3: root, in a forward outside training]" in error, error
        assert f"test_zero_alone.py:{line} in _lone_forward" in error, error
