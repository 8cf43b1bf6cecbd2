"""DeepSpeed training loops as DeepSpeed's documentation writes them, run once under real
DeepSpeed (``DS_IMPL=deepspeed``, torchrun) and once under ``longboat run`` with ``import
longboat.deepspeed as deepspeed``; each rank writes what it saw to ``OUT/rank<N>.json`` for
tests/test_deepspeed_side_by_side.py to compare.

Scenarios: the plain engine loop (``engine(x)``, ``backward``, ``step``) with a WarmupLR
scheduler from the config at ZeRO stages 0, 1, 2 and 3 (at stage 3 the model is built under
``deepspeed.zero.Init`` and read whole on rank 0 through ``deepspeed.zero.GatheredParameters``,
as DeepSpeed's ZeRO-3 tutorial does); ``save_checkpoint`` with a tag and ``client_state``, then
a fresh engine's ``load_checkpoint`` and the run resumed, at stages 1 and 3; a loop fed by a
``DistributedSampler`` over ``deepspeed.comm``'s ranks through ``deepspeed.utils.RepeatingLoader``,
on ``get_accelerator()``'s device, its loss averaged with ``deepspeed.comm.all_reduce``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if os.environ.get("DS_IMPL") == "deepspeed":
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import RepeatingLoader
else:
    import longboat.deepspeed as deepspeed
    from longboat.deepspeed.accelerator import get_accelerator
    from longboat.deepspeed.utils import RepeatingLoader

OUT = Path(sys.argv[1])
MICRO, GAS = 2, 2

g = torch.Generator().manual_seed(1)
X, Y = torch.randn(96, 4, generator=g), torch.randn(96, 1, generator=g)


def config(stage: int) -> dict:
    """What a DeepSpeed tutorial's ds_config.json holds (no gradient_clipping: the default)."""
    return {
        "train_batch_size": MICRO * GAS * 2,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 3},
        },
    }


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def build(stage: int):
    torch.manual_seed(0)
    if stage == 3:  # parameters partitioned as they are made, as DeepSpeed's ZeRO-3 docs build
        with deepspeed.zero.Init(config_dict_or_path=config(3)):
            model = net()
    else:
        model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config(stage))
    return engine


def micro_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-step ``step``'s samples for ``rank``: consecutive slices, rank after rank."""
    i = (step * 2 + rank) * MICRO
    return X[i : i + MICRO], Y[i : i + MICRO]


def train(engine, rank: int, first: int, last: int) -> dict:
    losses, lrs, boundaries, norms, samples = [], [], [], [], []
    for step in range(first, last):
        x, y = micro_batch(step, rank)
        loss = F.mse_loss(engine(x), y)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        lrs.append([float(lr) for lr in engine.get_lr()])
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        samples.append(engine.global_samples)
    return {
        "losses": losses,
        "lrs": lrs,
        "global_steps": engine.global_steps,
        "boundaries": boundaries,
        "norms": norms,
        "samples": samples,
    }


def params(engine) -> list[list[float]]:
    """Every parameter, whole (under ZeRO-3 gathered for the read: every rank enters)."""
    held = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(held, modifier_rank=None):
        return [p.detach().flatten().tolist() for p in held]


def last_weight_on_rank0(engine, rank: int) -> list[float] | None:
    """The last layer's weight read on rank 0 only, as DeepSpeed's docs read one under ZeRO-3."""
    weight = engine.module[2].weight
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=None):
        return weight.detach().flatten().tolist() if rank == 0 else None


def resume(stage: int, rank: int, ckpt: Path) -> dict:
    """Save mid-run, resume in a fresh engine and go on: as one uninterrupted run."""
    first = build(stage)
    before = train(first, rank, 0, 6)
    first.save_checkpoint(str(ckpt), tag="mid", client_state={"epoch": 3, "seen": 6})
    after = train(first, rank, 6, 10)
    second = build(stage)
    path, client = second.load_checkpoint(str(ckpt), tag="mid")
    resumed = train(second, rank, 6, 10)
    return {
        "before": before,
        "after": after,
        "resumed": resumed,
        "client": {k: client[k] for k in ("epoch", "seen")},
        "loaded": path is not None,
        "params_after": params(first),
        "params_resumed": params(second),
    }


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    out: dict = {}
    for stage in (0, 1, 2, 3):
        engine = build(stage)
        start = last_weight_on_rank0(engine, rank)
        run = train(engine, rank, 0, 12)
        run["stage"] = engine.zero_optimization_stage()
        run["batch"] = [
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ]
        run["params"] = params(engine)
        run["weight_on_rank0"] = [start, last_weight_on_rank0(engine, rank)]
        out[f"stage{stage}"] = run

    out["resume"] = resume(1, rank, OUT / "ckpt1")
    out["resume3"] = resume(3, rank, OUT / "ckpt3")

    # deepspeed.comm, the accelerator and RepeatingLoader, as the tutorials' data loops use them
    device = get_accelerator().device_name()
    data = TensorDataset(X, Y)
    sampler = DistributedSampler(
        data,
        num_replicas=deepspeed.comm.get_world_size(),
        rank=deepspeed.comm.get_rank(),
        shuffle=False,
    )
    loader = RepeatingLoader(DataLoader(data, batch_size=MICRO, sampler=sampler))
    engine = build(2)
    mean_losses = []
    for _ in range(60):  # more micro-batches than one epoch: the loader starts over
        x, y = next(loader)
        loss = F.mse_loss(engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        mean_losses.append(mean.item() / deepspeed.comm.get_world_size())
    deepspeed.comm.barrier()
    out["comm"] = {"mean_losses": mean_losses, "device": device, "steps": engine.global_steps}
    (OUT / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
