"""Shared pieces of the checkpoint tests: a training loop (as reference.train, with noise drawn
from every RNG a script may use) that can save and resume, run in one process or on each rank
of a pool."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import reference
import torch
from torch import nn

import longboat

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
EPOCH = 5  # steps per epoch: saves fall mid-epoch and runs cross epochs
QUIET = {"log": {"progress": False, "level": "WARNING"}}

# Each strategy's config; small buckets and per-module units give many units whose sizes do not
# divide the world size.
LAYOUTS: dict[str, dict[str, Any]] = {
    "single": {"strategy": "single"},
    "replicate": {
        "strategy": "replicate",
        "replicate": {"bucket_mb": 0.001, "first_bucket_mb": 0.0005},
    },
    "zero1": {"strategy": "zero", "zero": {"stage": 1, "bucket_mb": 0.001}},
    "zero2": {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.001}},
    "zero3": {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear", "LayerNorm"]}},
    # ZeRO-3 within pairs of ranks, replicated across the pairs (at 4 ranks: 2 x 2)
    "hsdp": {
        "strategy": "zero",
        "zero": {"stage": 3, "unit_classes": ["Linear", "LayerNorm"]},
        "mesh": {"dp_replicate": 2},
    },
}


def config(layout: str, world: int, **extra: Any) -> dict[str, Any]:
    return {
        **QUIET,
        **LAYOUTS[layout],
        "batch": {"train_batch_size": GLOBAL_BATCH, "micro_batch_size": GLOBAL_BATCH // world},
        # reference.Recipe's schedule, so a run can be replayed by the plain loop
        "scheduler": {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}},
        **extra,
    }


def build(cfg: dict[str, Any], model_name: str = "tiny") -> longboat.Engine:
    """The test model and AdamW, under ``cfg``; ranks other than 0 start from other weights
    (the strategy must broadcast rank 0's)."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = reference.MODELS[model_name]()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    return longboat.initialize(model, opt, cfg)


def train(
    engine: longboat.Engine,
    steps: int,
    ckpt: str | None = None,
    save_at: tuple[int, ...] = (),
    noise: bool = True,
) -> dict[str, Any]:
    """Train until ``engine.global_step == steps``, saving at the steps in ``save_at``.

    With ``noise``, inputs get noise from torch's RNG (different on each rank) and a scale from
    Python's and numpy's, so a resume that lost any RNG state would diverge. (Runs at different
    world sizes only agree without it.) Returns the sample ids of each step (a list per
    micro-batch) and the weights at each step in ``save_at``.
    """
    loader = engine.loader(reference.indexed(reference.dataset(GLOBAL_BATCH * EPOCH)))
    loss_fn = nn.CrossEntropyLoss()
    ids: list[list[list[int]]] = []
    step_ids: list[list[int]] = []
    saved: dict[int, dict[str, torch.Tensor]] = {}
    while engine.global_step < steps:
        for sample_ids, x, y in loader:
            if noise:
                scale = 0.01 * (random.random() + float(np.random.rand()))
                x = x + scale * torch.randn_like(x)
            engine.backward(loss_fn(engine(x), y))
            step_ids.append(sample_ids.tolist())
            if engine.step():
                ids.append(step_ids)
                step_ids = []
                if engine.global_step in save_at:
                    if ckpt is not None:
                        engine.save_checkpoint(ckpt)
                    saved[engine.global_step] = weights(engine)
            if engine.global_step == steps:
                break
    return {"ids": ids, "saved": saved}


def weights(engine: longboat.Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.state_dict().items()}


def result(engine: longboat.Engine) -> dict[str, Any]:
    """Final weights, this rank's optimizer state in order, RNG draws, and the step."""
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    optim = [
        (k, t.clone())
        for g in engine.optimizer.param_groups
        for p in g["params"]
        for k, t in sorted(engine.optimizer.state.get(p, {}).items())
        if isinstance(t, torch.Tensor)
    ]
    lr = [g["lr"] for g in engine.optimizer.param_groups]
    draws = [torch.rand(3), random.random(), float(np.random.rand())]
    scaler = getattr(getattr(engine, "precision", None), "scaler", None)
    out = {
        "state": state,
        "optim": optim,
        "lr": lr,
        "draws": draws,
        "step": engine.global_step,
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    engine.close()
    return out


def run(
    layout: str,
    world: int,
    steps: int,
    ckpt: str | None = None,
    save_at: tuple[int, ...] = (),
    load: bool = False,
    model_name: str = "tiny",
    noise: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """Build, optionally resume from ``ckpt``, train to ``steps``; the result, with what the
    load restored (``loaded_step``, ``loaded`` weights beside the ``fresh`` ones it replaced)
    and what training saw and saved (``trained``: see :func:`train`)."""
    engine = build(config(layout, world, **extra), model_name)
    out: dict[str, Any] = {}
    if load:
        out["fresh"] = weights(engine)
        engine.load_checkpoint(ckpt)
        out["loaded_step"] = engine.global_step
        out["loaded"] = weights(engine)
    out["trained"] = train(engine, steps, ckpt, save_at, noise)
    return {**result(engine), **out}
