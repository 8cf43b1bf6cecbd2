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
