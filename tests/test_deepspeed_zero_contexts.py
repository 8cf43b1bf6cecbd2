"""``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` on longboat's ZeRO-3
([Note: DeepSpeed zero contexts]): a model built under ``Init`` starts as the eagerly built
one, ``GatheredParameters`` shows whole parameters and keeps rank ``modifier_rank``'s writes
(only them), and training then goes on as a plain PyTorch loop from the modified weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import longboat.deepspeed as deepspeed
from longboat.config import ConfigError

CFG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 0,
    "zero_optimization": {"stage": 3},
}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _zero3_contexts() -> dict:
    rank = deepspeed.comm.get_rank() if torch.distributed.is_initialized() else 0
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=CFG):
        model = _net()
    on_meta = all(p.is_meta for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=CFG)
    start = engine.engine.state_dict()
    torch.manual_seed(0)
    plain = _net()  # eagerly, from the same random state
    same_start = all(torch.equal(start[k], v) for k, v in plain.state_dict().items())

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        shapes = [tuple(p.shape) for p in params]
        with torch.no_grad():
            model[2].bias.fill_(0.5 if rank == 0 else 9.0)  # only rank 0's write is kept
    # read-only: this write is dropped
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        model[2].bias.fill_(7.0)
    bias = engine.engine.state_dict()["2.bias"].tolist()

    # one step from the modified weights, against a plain loop over the whole batch
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    mine = slice(4 * rank, 4 * rank + 4)
    engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
    engine.step()
    with torch.no_grad():
        plain[2].bias.fill_(0.5)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    nn.functional.mse_loss(plain(x), y).backward()
    ref.step()
    end = engine.engine.state_dict()
    diff = max((end[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    engine.destroy()
    return {
        "meta": on_meta,
        "same_start": same_start,
        "shapes": shapes,
        "bias": bias,
        "diff": diff,
    }


def test_init_and_gathered_parameters_under_zero3(ranks):
    for r in ranks(2, _zero3_contexts):
        assert r["meta"] and r["same_start"]
        assert r["shapes"] == [(8, 4), (8,), (1, 8), (1,)]
        assert r["bias"] == [0.5]
        assert r["diff"] < 1e-6


def test_gathered_parameters_of_whole_parameters_does_nothing():
    model = _net()
    with deepspeed.zero.GatheredParameters(model.parameters(), modifier_rank=0), torch.no_grad():
        model[2].bias.fill_(0.25)
    assert model[2].bias.item() == 0.25  # no engine shards it: the module's own tensor


def test_init_refuses_what_it_cannot_honour():
    with pytest.raises(ConfigError, match=r"remote_device.*zero\.offload_param"):
        deepspeed.zero.Init(remote_device="cpu")
    with pytest.raises(ConfigError, match="dtype"):
        deepspeed.zero.Init(dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"ZeRO stage is 2.*zero_optimization\.stage to 3"):
        deepspeed.zero.Init(config_dict_or_path={**CFG, "zero_optimization": {"stage": 2}})
    with deepspeed.zero.Init(enabled=False):
        assert not next(_net().parameters()).is_meta
