"""DeepSpeed's module-level helpers under ``import longboat.deepspeed as deepspeed``:
``deepspeed.comm``, ``deepspeed.accelerator``, ``deepspeed.utils.RepeatingLoader``,
``deepspeed.checkpointing`` and the engine's ``get_global_grad_norm()``, each against plain
torch ([Note: DeepSpeed comm], [Note: DeepSpeed accelerator], [Note: DeepSpeed checkpointing])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import longboat.deepspeed as deepspeed
from longboat.config import ConfigError


def test_comm_in_a_world_of_one_is_one_rank_and_before_a_group_a_clear_error(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert not dist.is_initialized()
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()) == (0, 1)
    t = torch.tensor([1.0, 2.0])
    deepspeed.comm.all_reduce(t)
    deepspeed.comm.broadcast(t, 0)
    out = [torch.zeros(2)]
    deepspeed.comm.all_gather(out, t)
    assert t.tolist() == [1.0, 2.0] and out[0].tolist() == [1.0, 2.0]
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ConfigError, match=r"rank 1 of 2 .*deepspeed.init_distributed\(\)"):
        deepspeed.comm.get_rank()


def _collectives() -> dict:
    comm = deepspeed.comm
    rank = comm.get_rank()
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t)
    m = torch.tensor([float(rank + 1)])
    comm.all_reduce(m, op=comm.ReduceOp.MAX)
    b = torch.tensor([float(rank * 10)])
    comm.broadcast(b, src=1)
    parts = [torch.zeros(1) for _ in range(comm.get_world_size())]
    comm.all_gather(parts, torch.tensor([float(rank)]))
    comm.barrier()
    return {
        "rank": [rank, dist.get_rank()],
        "size": comm.get_world_size(),
        "sum": t.item(),
        "max": m.item(),
        "bcast": b.item(),
        "gathered": [p.item() for p in parts],
        "local": comm.get_local_rank(),
    }


def test_comm_collectives_are_torch_distributeds(ranks):
    res = ranks(2, _collectives)
    for r, out in enumerate(res):
        assert out == {
            "rank": [r, r],
            "size": 2,
            "sum": 3.0,
            "max": 2.0,
            "bcast": 10.0,
            "gathered": [0.0, 1.0],
            "local": r,
        }


def test_the_accelerator_answers_for_the_cpu_here():
    acc = deepspeed.accelerator.get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu"
    assert acc.current_device_name() == "cpu" and acc.current_device() == 0
    assert acc.is_available() and acc.communication_backend_name() == "gloo"
    assert acc.on_accelerator(torch.zeros(1)) and torch.device(acc.current_device_name()).type
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    assert torch.float32 in acc.supported_dtypes() and acc.memory_allocated() == 0


def test_repeating_loader_starts_over_and_an_empty_one_ends():
    loader = deepspeed.utils.RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(StopIteration):
        next(deepspeed.utils.RepeatingLoader([]))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x))) * scale


def _grads(checkpointed: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 6, requires_grad=True)
    torch.manual_seed(1)  # the dropout mask: drawn once in the forward, again when recomputed
    if checkpointed:
        out = deepspeed.checkpointing.checkpoint(block, x, scale=2.0)
    else:
        out = block(x, scale=2.0)
    out.square().sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("in_cpu", [False, True])
def test_checkpoint_gives_the_plain_calls_gradients(in_cpu):
    deepspeed.checkpointing.configure(None, checkpoint_in_cpu=in_cpu)
    try:
        assert deepspeed.checkpointing.is_configured()
        plain, ckpt = _grads(False), _grads(True)
    finally:
        deepspeed.checkpointing.reset()
    assert not deepspeed.checkpointing.is_configured()
    for a, b in zip(plain, ckpt, strict=True):
        assert torch.equal(a, b)


def test_checkpointing_configure_refuses_what_deepspeed_refuses():
    with pytest.raises(ConfigError, match="mpu_"):
        deepspeed.checkpointing.configure(object())
    with pytest.raises(ConfigError, match="needs partition_activations"):
        deepspeed.checkpointing.configure(None, contiguous_checkpointing=True)
    cfg = {"activation_checkpointing": {"partition_activations": True}}
    with pytest.raises(ConfigError, match="needs num_checkpoints"):
        deepspeed.checkpointing.configure(None, cfg, contiguous_checkpointing=True)
    assert not deepspeed.checkpointing.is_configured()


def _grad_norm() -> dict:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    # the plain loop: the whole batch's gradient norm, before clipping
    plain = build()
    nn.functional.mse_loss(plain(x), y).backward()
    want = float(torch.cat([p.grad.flatten() for p in plain.parameters()]).norm())
    model = build()
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    before = engine.get_global_grad_norm()
    rank = deepspeed.comm.get_rank()
    mine = slice(4 * rank, 4 * rank + 4)
    engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
    engine.step()
    got = engine.get_global_grad_norm()
    engine.destroy()
    return {"before": before, "got": got, "want": want}


def test_global_grad_norm_is_the_whole_batchs_norm(ranks):
    for r in ranks(2, _grad_norm):
        assert r["before"] is None
        assert r["got"] == pytest.approx(r["want"], rel=1e-5)


def test_a_deepspeed_config_without_gradient_clipping_clips_at_deepspeeds_default():
    """DeepSpeed 0.19.8 clips at 1.0 when the key is absent ([Note: DeepSpeed clips by
    default]); tests/test_deepspeed_side_by_side.py shows it against real DeepSpeed."""
    from longboat.config.loading import explain, load

    assert load({"train_batch_size": 8}).config.gradient_clipping == 1.0
    assert load({"train_batch_size": 8, "gradient_clipping": 0}).config.gradient_clipping == 0
    assert load({"train_batch_size": 8, "gradient_clipping": 0.5}).config.gradient_clipping == 0.5
    assert load({"batch": {"train_batch_size": 8}}).config.gradient_clipping == 0  # longboat's
    line = next(ln for ln in explain({"train_batch_size": 8}, 2).splitlines() if "clipping" in ln)
    assert "DeepSpeed's default (no 'gradient_clipping' in dict)" in line


def _no_sync(stage: int) -> dict:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0,
        "zero_optimization": {"stage": stage},
    }
    model = build()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
    )
    rank = deepspeed.comm.get_rank()

    def part(step: int, half: int, r: int) -> slice:
        i = step * 8 + half * 4 + r * 2
        return slice(i, i + 2)

    refused = ""
    for step in range(3):
        with engine.no_sync():  # the first half stays on this rank
            a = part(step, 0, rank)
            engine.backward(nn.functional.mse_loss(engine(x[a]), y[a]))
            if step == 0:  # ZeRO-1 keeps gradients in its flat buffers, not in .grad
                inside = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                try:
                    engine.step()
                except ConfigError as e:
                    refused = str(e)
        b = part(step, 1, rank)
        engine.backward(nn.functional.mse_loss(engine(x[b]), y[b]))
        engine.step()
    # the plain loop: each step's gradient is the mean over ranks of both halves' sum
    plain = build()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        for half in range(2):
            for r in range(2):
                s = part(step, half, r)
                (nn.functional.mse_loss(plain(x[s]), y[s]) / 2).backward()
        opt.step()
    got = engine.engine.state_dict()
    diff = max((got[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    # inside, the gradient is this rank's own (nothing reduced): the plain one of its batch
    local = build()
    a = part(0, 0, rank)
    nn.functional.mse_loss(local(x[a]), y[a]).backward()
    own = stage > 0 or all(
        torch.equal(g, p.grad) for g, p in zip(inside, local.parameters(), strict=True)
    )
    out = {
        "diff": diff,
        "steps": engine.global_steps,
        "micro": engine.micro_steps,
        "refused": refused,
        "own": own,
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_no_sync_accumulates_locally_until_the_next_backward(ranks, stage):
    for r in ranks(2, _no_sync, stage):
        assert r["diff"] < 1e-6 and r["steps"] == 3
        assert r["micro"] == 3 and r["own"]  # no micro-step and no reduction inside
        assert "step() inside no_sync()" in r["refused"]


def _no_sync_at_stage_2() -> str:
    model = nn.Linear(4, 1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg
    )
    try:
        with engine.no_sync():
            pass
    except ConfigError as e:
        return str(e)
    finally:
        engine.destroy()
    return ""


def test_no_sync_is_refused_where_gradients_are_partitioned(ranks):
    for msg in ranks(2, _no_sync_at_stage_2):
        assert "incompatible with ZeRO stage 2" in msg
