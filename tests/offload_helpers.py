"""Shared pieces of the offload tests (tests/test_offload.py: optimizer state on disk;
tests/test_offload_param.py: parameters and gradients too): the disk's config, the run against
the plain loop, a few steps of the zoo model whose engine the caller inspects, and checkpoints
moved between offloaded and in-memory runs."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import harness
import pytest
import reference
import torch
from torch import nn

import longboat
from longboat.strategies.zero import homes
from longboat.strategies.zero.offload import SWAP_DIR

STEPS = 6
GLOBAL_BATCH = 16
# stage 3: units that every rank runs (the routed experts inside one), besides the root
ZOO_UNITS = {"unit_classes": ["Experts", "LSTM"]}


def disk(path: Path, buffer_count: int = 2) -> dict[str, Any]:
    """An ``offload_optimizer`` or ``offload_param`` section that puts the swap under ``path``."""
    return {"device": "disk", "path": str(path), "buffer_count": buffer_count}


def swap_files(path: Path) -> list[Path]:
    """The swap files under ``path`` (an offload section's path)."""
    return list((path / SWAP_DIR).glob("*.bin"))


def equals_plain_pytorch(
    ranks: Any, world: int, strategy: dict[str, Any], recipe: reference.Recipe, path: Path
) -> None:
    """``recipe`` under ``strategy`` (swapping under ``path``) against the plain loop: STEPS
    steps of 2 micro-batches, 1e-5 relative; no swap file is left after close()."""
    harness.run_and_compare(ranks, world, strategy, recipe, STEPS, 2, GLOBAL_BATCH, tol=1e-5)
    assert not swap_files(path), "files left after close()"


def train_zoo(cfg: dict[str, Any], steps: int) -> longboat.Engine:
    """``steps`` steps of the zoo model with AdamW under ``cfg``; the engine, still open."""
    recipe = reference.Recipe(model="zoo", optimizer="adamw")
    model, opt, _ = recipe.build()
    engine = longboat.initialize(model, opt, cfg)
    data = harness.data_for(recipe, engine.batch.train_batch_size * steps)
    for batch in engine.loader(data):
        _, *rest = batch
        engine.backward(reference.forward_loss(engine, rest))
        engine.step()
    return engine


def checkpoints_move(
    ranks: Any,
    tmp_path: Path,
    saving: dict[str, Any],
    plain: dict[str, Any],
    loading: dict[str, Any],
) -> None:
    """A checkpoint saved by 2 ranks under ``saving`` after 3 steps loads, exactly, into 1
    rank under ``plain`` and into 2 ranks under ``loading``: the state and every piece of the
    optimizer state (AdamW's moments among them)."""
    base = {**harness.QUIET, "batch": {"train_batch_size": 8}}
    ckpt = str(tmp_path / "ckpt")
    saved = ranks(2, harness.save_or_load, {**base, **saving}, ckpt, 3)
    single = ranks(1, harness.save_or_load, {**base, **plain}, ckpt, 0)
    back = ranks(2, harness.save_or_load, {**base, **loading}, ckpt, 0)
    want = harness.assemble(saved)
    assert any(k == "exp_avg" for v in want.values() for k in v)
    for res in (single, back):
        got = harness.assemble(res)
        assert got.keys() == want.keys()
        for name, keys in want.items():
            for k, v in keys.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert reference.max_rel_diff({k: got[name][k]}, {k: v}) == 0.0, (name, k)
                else:
                    assert got[name][k] == v, (name, k)
        assert reference.max_rel_diff(res[0]["state"], saved[0]["state"]) == 0.0


# -- host offload ([Note: host copies on CPU] in zero/host.py) ----------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"
)


def host_copies(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn`` on this rank with ZeRO's host homes built for ``device = "cpu"`` although the rank
    computes on the CPU ([Note: host copies on CPU])."""
    original = homes.build
    homes.build = functools.partial(original, host_copies=True)  # type: ignore[assignment]
    try:
        return fn(*args, **kwargs)
    finally:
        homes.build = original


def small_net() -> nn.Module:
    """The GPU tests' model, from seed 0."""
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)]
    return nn.Sequential(*layers)
