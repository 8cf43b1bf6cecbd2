"""The parameter server against the plain PyTorch loop of ``reference.py``, and its modes,
faults and state."""

from __future__ import annotations

import harness
import pytest
import reference

STEPS = 6
GLOBAL_BATCH = 16


def _ps(servers: int = 1, mode: str = "sync", **more) -> dict:
    return {
        "strategy": "parameter_server",
        "parameter_server": {"servers": servers, "mode": mode, **more},
    }


@pytest.mark.parametrize(
    ("workers", "servers", "accum", "model", "optimizer", "update_on_server", "clip"),
    [
        # BatchNorm buffers, routed (conditionally used), never-used and frozen parameters:
        # a parameter no worker used must not move under AdamW (weight decay) on the servers
        (1, 1, 1, "zoo", "adamw", True, 0.0),
        (2, 1, 1, "zoo", "adamw", True, 0.0),
        (4, 2, 2, "zoo", "adamw", True, 0.0),
        (2, 1, 1, "tied", "sgd", True, 0.0),  # one weight in two modules: one key entry
        # servers only average; the workers step, clip by the mean gradient's norm
        (2, 1, 1, "zoo", "adamw", False, 0.5),
        (4, 1, 1, "tied", "sgd", False, 0.0),
    ],
)
def test_sync_equals_plain_pytorch(
    ranks, workers, servers, accum, model, optimizer, update_on_server, clip
):
    recipe = reference.Recipe(model=model, optimizer=optimizer, clip=clip)
    harness.run_and_compare(
        ranks,
        workers + servers,
        _ps(servers, update_on_server=update_on_server),
        recipe,
        STEPS,
        accum,
        GLOBAL_BATCH,
        tol=1e-5,
    )


def test_ssp_with_staleness_0_equals_plain_pytorch(ranks):
    # a worker may run no clock ahead: every pull waits for every worker's push, as in sync
    # (but without collectives between workers, each keeps its own BatchNorm statistics)
    recipe = reference.Recipe(model="zoo", optimizer="adamw")
    harness.run_and_compare(
        ranks,
        3,
        _ps(1, "ssp", staleness=0),
        recipe,
        STEPS,
        1,
        GLOBAL_BATCH,
        tol=1e-5,
        own_buffers=True,
    )


def _digits(cfg: dict, epochs: int) -> dict:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import TensorDataset

    import longboat
    from longboat.models import DigitsCNN

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    # the default example's split (examples/digits.py)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train, test = TensorDataset(xtr, ytr), (xte, yte)
    longboat.seed_everything(0)
    model = DigitsCNN()
    try:
        engine = longboat.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cfg)
    except longboat.ps.ServerExit as served:
        return {"served": served.summary}
    for _ in range(epochs):
        for xb, yb in engine.loader(train):
            engine.backward(torch.nn.functional.cross_entropy(engine(xb), yb))
            engine.step()
    engine.eval()
    with torch.no_grad():
        accuracy = (engine(test[0]).argmax(1) == test[1]).float().mean().item()
    staleness = getattr(engine.strategy, "staleness", {})
    steps = engine.global_step
    engine.close()
    return {"accuracy": accuracy, "steps": steps, **staleness}


@pytest.mark.parametrize(("mode", "staleness"), [("async", 0), ("ssp", 2)])
def test_async_and_ssp_converge_on_digits(ranks, mode, staleness):
    cfg = {
        **harness.QUIET,
        **_ps(1, mode, staleness=staleness),
        "batch": {"train_batch_size": 64},
        "data": {"remainder": "drop"},
    }
    results = ranks(3, _digits, cfg, 10, timeout=300)
    workers, (server,) = results[:2], [r["served"] for r in results[2:]]
    for w in workers:
        assert w["accuracy"] >= 0.95, w
        assert w["max_staleness"] <= (staleness if mode == "ssp" else 10**9)
    # every push of every worker was applied: 2 workers x 22 steps x 10 epochs
    assert sum(w["pushes"] for w in server["workers"]) == 2 * workers[0]["steps"]
    assert not any(w["dead"] for w in server["workers"])
