"""DeepSpeed's pipeline tutorial as a script, run once under real DeepSpeed (``DS_IMPL=deepspeed``,
torchrun, 2 ranks = 2 stages) and once under ``longboat run`` with the imports changed; each rank
writes what it saw to ``OUT/rank<N>.json`` for tests/test_deepspeed_pipe_side_by_side.py.

The script does what DeepSpeed's pipeline tutorial shows: ``deepspeed.init_distributed()``, a
``PipelineModule`` of ``LayerSpec`` layers with a ``loss_fn``, ``num_stages=2`` and a
``partition_method`` (``parameters``, ``uniform``, ``type:Linear``; and a ``TiedLayerSpec`` used
on both stages), ``deepspeed.initialize(model=..., model_parameters=..., config=...)`` with the
optimizer and a WarmupLR scheduler in the config, ``train_batch(data_iter=...)``,
``eval_batch``, then ``save_checkpoint(dir, tag=..., client_state=...)``, a fresh engine's
``load_checkpoint(dir, tag=...)`` and more ``train_batch`` steps. The optimizer block asks for
torch's AdamW (``torch_adam``): DeepSpeed's own Adam on the CPU is a C++ extension it compiles
at its first use, minutes on a small machine; longboat's is torch's either way.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

if os.environ.get("DS_IMPL") == "deepspeed":
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
else:
    import longboat.deepspeed as deepspeed
    from longboat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

OUT = Path(sys.argv[1])
MICRO, GAS = 2, 4

g = torch.Generator().manual_seed(1)
X, Y = torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g)

CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 0,  # DeepSpeed's pipeline clips by stage 0's norm alone: see the test
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 0.05, "weight_decay": 0.01, "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 3},
    },
}


def layers(tied: bool) -> list:
    """Nine layers whose three partitions differ; or a tied 4x4 map at both ends."""
    if tied:  # the same module's weights on stage 0 and stage 1
        ends = [TiedLayerSpec("io", nn.Linear, 4, 4, tied_weight_attr=["weight", "bias"])]
        middle = [LayerSpec(nn.Linear, 4, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 4)]
        return [*ends, LayerSpec(nn.Tanh), *middle, *ends, LayerSpec(nn.Linear, 4, 1)]
    widths = [4, 16, 8, 8, 8, 1]
    out: list = []
    for a, b in itertools.pairwise(widths):
        out += [LayerSpec(nn.Linear, a, b), LayerSpec(nn.Tanh)]
    return out[:-1]


def build(method: str, tied: bool = False):
    torch.manual_seed(0)
    model = PipelineModule(
        layers=layers(tied), loss_fn=nn.MSELoss(), num_stages=2, partition_method=method
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=CONFIG,
    )
    return engine


def batches(first: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches from micro-batch ``first`` on, the same on both stages."""
    i = first
    while True:
        yield X[i * MICRO : (i + 1) * MICRO], Y[i * MICRO : (i + 1) * MICRO]
        i += 1


def weights(engine) -> dict[str, list[float]]:
    """This stage's parameters by name (tied ones under each framework's own name)."""
    return {n: p.detach().flatten().tolist() for n, p in engine.module.named_parameters()}


def train(engine, data: Iterator, steps: int) -> dict:
    losses, shapes, lrs, norms, samples = [], [], [], [], []
    for _ in range(steps):
        loss = engine.train_batch(data_iter=data)
        losses.append(float(loss))
        shapes.append(list(loss.shape))
        lrs.append([float(lr) for lr in engine.get_lr()])
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
        samples.append(engine.global_samples)
    return {
        "losses": losses,
        "shapes": shapes,
        "lrs": lrs,
        "norms": norms,
        "samples": samples,
        "global_steps": engine.global_steps,
    }


def evaluate(engine, first: int) -> dict:
    """``eval_batch``, and the module's mode after it and after the next ``train_batch``."""
    loss = engine.eval_batch(data_iter=batches(first))
    training = [engine.module.training]
    engine.train_batch(data_iter=batches(first))
    training.append(engine.module.training)
    return {"loss": float(loss), "shape": list(loss.shape), "training": training}


def balanced_partitions() -> list[list[int]]:
    """DeepSpeed's partition_balanced, and longboat's reimplementation of its answers, on
    awkward weights and 2 to 4 stages (beyond the 2 stages this script's ranks make)."""
    if os.environ.get("DS_IMPL") == "deepspeed":
        from deepspeed.runtime.utils import partition_balanced
    else:
        from longboat.deepspeed.partition import deepspeed_balanced as partition_balanced
    g = torch.Generator().manual_seed(5)
    out = []
    for n in range(4, 12):
        weights = torch.randint(0, 40, (n,), generator=g)
        weights[torch.randint(0, n, (1,), generator=g)] = 300  # one big layer
        weights[torch.randint(0, n, (2,), generator=g)] = 0  # and parameterless ones
        for stages in (2, 3, 4):
            out.append([int(b) for b in partition_balanced(weights.tolist(), stages)])
    return out


def scenario(method: str, tied: bool = False) -> dict:
    engine = build(method, tied)
    start = weights(engine)
    data = batches(0)
    out = train(engine, data, 5)
    module = engine.module  # the stages' first layers: DeepSpeed's ``parts``, longboat's ``bounds``
    out.update(
        bounds=[int(b) for b in getattr(module, "parts", None) or module.bounds],
        start=start,
        end=weights(engine),
        eval=evaluate(engine, 100),
        batch=[
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ],
    )
    return out


def resume(rank: int) -> dict:
    """Save after 3 steps, 2 more; a fresh engine loads the save and runs the same 2."""
    first = build("parameters")
    before = train(first, batches(0), 3)
    ckpt = OUT / "ckpt"
    first.save_checkpoint(str(ckpt), tag="step3", client_state={"epoch": 1, "seen": 24})
    after = train(first, batches(3 * GAS), 2)
    second = build("parameters")
    path, client = second.load_checkpoint(str(ckpt), tag="step3")
    resumed = train(second, batches(3 * GAS), 2)
    return {
        "before": before,
        "after": after,
        "resumed": resumed,
        "loaded": path is not None,
        "client": {k: client[k] for k in ("epoch", "seen")},
        "same_weights": weights(first) == weights(second),
        "rank": rank,
    }


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    out = {method: scenario(method) for method in ("parameters", "uniform", "type:Linear")}
    out["tied"] = scenario("uniform", tied=True)
    out["resume"] = resume(rank)
    out["balanced"] = balanced_partitions()
    (OUT / f"rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
