"""DeepSpeed's ``engine.eval_batch(data_iter)``: the module's loss without gradients, in eval
mode, through the pipeline's stages, averaged over micro-batches and data-parallel ranks, equal
to a plain PyTorch evaluation of the same layers; the module is left in eval mode, as DeepSpeed
leaves it, until the next ``train_batch``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import longboat.deepspeed as deepspeed
from longboat.config import ConfigError
from longboat.deepspeed.pipe import PipelineModule


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Linear(6, 6),
        nn.Tanh(),
        nn.Dropout(0.5),
        nn.Linear(6, 6),
        nn.Tanh(),
        nn.Linear(6, 3),
    ]


def _eval(pipeline: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    xs, ys = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    if pipeline:  # 2 stages, one pipeline: every micro-batch goes through both ranks
        model: nn.Module = PipelineModule(
            _layers(), num_stages=2, loss_fn=F.cross_entropy, partition_method="uniform"
        )
        batches = [(xs[i : i + 2], ys[i : i + 2]) for i in range(0, 8, 2)]
    else:  # 2 data-parallel ranks, each with its own 4 micro-batches
        model = nn.Sequential(*_layers())
        model.loss_fn = F.cross_entropy
        rank = torch.distributed.get_rank()
        batches = [(xs[i : i + 2], ys[i : i + 2]) for i in range(8 * rank, 8 * rank + 8, 2)]
    engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=None)
    try:
        engine.eval_batch(iter(batches), return_logits=True)
    except ConfigError as e:
        refused = str(e)
    loss = engine.eval_batch(iter(batches)).item()
    training = [engine.module.training]
    engine.train_batch(iter(batches))
    training.append(engine.module.training)
    engine.destroy()
    plain = nn.Sequential(*_layers()).eval()
    count = 4 if pipeline else 8
    with torch.no_grad():
        want = (
            sum(
                F.cross_entropy(plain(xs[i : i + 2]), ys[i : i + 2]).item()
                for i in range(0, 2 * count, 2)
            )
            / count
        )
    return {"loss": loss, "want": want, "training": training, "refused": refused}


@pytest.mark.parametrize("pipeline", [True, False], ids=["pp2", "dp2"])
def test_eval_batch_is_the_plain_evaluation(ranks, pipeline):
    for r in ranks(2, _eval, pipeline):
        assert r["loss"] == pytest.approx(r["want"], rel=1e-6)
        assert r["training"] == [False, True]  # eval mode until train_batch, as in DeepSpeed
        assert "eval_batch(return_logits=True) is not supported" in r["refused"]
