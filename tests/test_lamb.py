"""``longboat.optim.Lamb`` ([Note: LAMB rule]): against a direct computation of DeepSpeed
FusedLamb's published rule on known tensors, with the trust ratio clamped both ways; a DeepSpeed
config with ``"type": "Lamb"`` trained at 1, 2 and 4 ranks against a plain PyTorch loop applying
that rule; and strategy ``zero`` refusing it by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longboat.config import ConfigError, load_config
from longboat.optim import Lamb, build_optimizer

HP = {
    "lr": 0.005,
    "weight_decay": 0.01,
    "bias_correction": False,
    "max_coeff": 0.3,
    "min_coeff": 0.01,
}  # fmt: skip  (the corpus's dse_cifar_ds_config_lamb.json)


def lamb_rule(p, g, m, v, t, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
              eps_inside_sqrt=False, weight_decay=0.0, max_coeff=10.0, min_coeff=0.01):  # fmt: skip
    """One LAMB step as DeepSpeed's fused kernel writes it, in float64, nothing in place:
    returns (new p, m, v, trust ratio)."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = torch.sqrt(v + eps) if eps_inside_sqrt else torch.sqrt(v) + eps
    u = m / denom + weight_decay * p
    w_norm = math.sqrt(float((p * p).sum()))
    u_norm = math.sqrt(float((u * u).sum()))
    ratio = 1.0
    if w_norm != 0 and u_norm != 0:
        ratio = min(max(w_norm / u_norm, min_coeff), max_coeff)
    step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
    return p - step_size * ratio * u, m, v, ratio


def test_one_step_on_numbers_worked_by_hand():
    p = nn.Parameter(torch.tensor([3.0, 4.0]))
    p.grad = torch.tensor([1.0, 1.0])
    opt = Lamb([p], lr=0.1)
    opt.step()
    # m = 0.1 g, sqrt(v) = sqrt(0.001) |g|: u = (sqrt(10), sqrt(10)), |u| = sqrt(20); |p| = 5;
    # step = 0.1 sqrt(0.001) / 0.1 * (5 / sqrt(20)) * sqrt(10) = 0.1 * 5 / sqrt(20) * 1
    # ... = 0.1 * 1.1180340 on each element
    assert torch.allclose(p.detach(), torch.tensor([3.0, 4.0]) - 0.1 * 5 / math.sqrt(20) * 1.0)
    assert opt.get_lamb_coeffs() == pytest.approx([5 / math.sqrt(20)])


@pytest.mark.parametrize(
    ("hp", "start", "want_ratio"),
    [
        ({}, 1.0, None),  # ratio inside the bounds
        (HP, 100.0, "max"),  # |p| / |u| = O(30) > max_coeff 0.3: clamped to it
        ({"min_coeff": 0.5, "max_coeff": 10.0}, 1e-3, "min"),  # tiny weights: clamped to min
        ({"eps_inside_sqrt": True, "weight_decay": 0.1, "betas": (0.8, 0.99)}, 1.0, None),
        ({}, 0.0, 1.0),  # |p| = 0 at the first step: ratio 1
    ],
)
def test_three_steps_follow_the_published_rule(hp, start, want_ratio):
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(4, 5, generator=gen, dtype=torch.float64) * start
    grads = [torch.randn(4, 5, generator=gen, dtype=torch.float64) for _ in range(3)]
    p = nn.Parameter(p0.float())
    opt = Lamb([p], **hp)
    want, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    ratios = []
    for t, g in enumerate(grads, start=1):
        p.grad = g.float()
        opt.step()
        want, m, v, ratio = lamb_rule(want, g, m, v, t, **hp)
        ratios.append(ratio)
        assert torch.allclose(p.detach().double(), want, rtol=1e-5, atol=1e-7), t
        assert opt.get_lamb_coeffs()[0] == pytest.approx(ratio, rel=1e-5)
        assert torch.allclose(opt.state[p]["exp_avg"].double(), m, rtol=1e-5, atol=1e-8)
        assert torch.allclose(opt.state[p]["exp_avg_sq"].double(), v, rtol=1e-5, atol=1e-10)
    if want_ratio == "max":
        assert ratios == [hp["max_coeff"]] * 3
    elif want_ratio == "min":
        assert ratios == [hp["min_coeff"]] * 3
    elif want_ratio is not None:
        assert ratios[0] == want_ratio
    else:
        assert all(0.01 < r < 10.0 for r in ratios)


def test_deepspeed_lamb_config_builds_longboat_lamb_with_its_parameters():
    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": HP}})
    assert cfg.optimizer is not None and cfg.optimizer.type == "Lamb"
    opt = build_optimizer([nn.Parameter(torch.zeros(2))], cfg.optimizer)
    assert isinstance(opt, Lamb)
    assert {k: opt.defaults[k] for k in HP} == HP
    for params, named in (({"lr": -1}, r"Lamb: lr=-1"), ({"max_grad_norm": 1}, "max_grad_norm")):
        bad = load_config({"train_batch_size": 8, "optimizer": {"type": "Lamb", "params": params}})
        with pytest.raises(ConfigError, match=rf"'optimizer\.params'.*{named}"):
            build_optimizer([nn.Parameter(torch.zeros(2))], bad.optimizer)


# -- training -------------------------------------------------------------------------------------


class Net(nn.Module):
    """Used, frozen and never-used parameters: Lamb skips what has no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.b = nn.Linear(8, 3)
        self.unused = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.frozen(torch.tanh(self.a(x)))))


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(steps)]  # fmt: skip


def _ds_config(world: int, zero: int = 0) -> dict:
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 8 // world,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Lamb", "params": {**HP, "lr": 0.05, "bias_correction": True}},
        "zero_optimization": {"stage": zero},
    }


def _train(steps: int) -> dict:
    import longboat

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.manual_seed(0)
    model = Net()
    engine = longboat.initialize(model, None, _ds_config(world))
    assert isinstance(engine.optimizer, Lamb)
    m = 8 // world
    losses = []
    for x, y in _data(steps):
        loss = F.cross_entropy(engine(x[rank * m : (rank + 1) * m]), y[rank * m : (rank + 1) * m])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = {n: engine.optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()
             if p in engine.optimizer.state}  # fmt: skip
    engine.close()
    return {"losses": losses, "params": params, "state": state}


def _reference(steps: int, world: int) -> dict:
    """Plain PyTorch: the full batch's mean loss (the mean of the ranks' slices' means), global
    norm clipping to 1.0, then the rule above on every parameter with a gradient."""
    torch.manual_seed(0)
    model = Net()
    hp = {**HP, "lr": 0.05, "bias_correction": True}
    st: dict[str, list] = {}
    m = 8 // world
    losses: list[list[float]] = [[] for _ in range(world)]
    for t, (x, y) in enumerate(_data(steps), start=1):
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        for r in range(world):
            with torch.no_grad():
                part = F.cross_entropy(model(x[r * m : (r + 1) * m]), y[r * m : (r + 1) * m])
            losses[r].append(part.item())
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.grad is None:
                    continue
                mm, vv = st.get(n, [torch.zeros_like(p), torch.zeros_like(p)])
                new, mm, vv, _ = lamb_rule(p.detach(), p.grad, mm, vv, t, **hp)
                p.copy_(new)
                st[n] = [mm, vv]
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "params": params, "state": {n: s[0] for n, s in st.items()}}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_deepspeed_lamb_config_trains_as_plain_pytorch(ranks, world):
    got = ranks(world, _train, 4)
    want = _reference(4, world)
    for r, out in enumerate(got):
        for a, b in zip(out["losses"], want["losses"][r], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (r, out["losses"], want["losses"][r])
        for k, v in want["params"].items():
            assert (out["params"][k] - v).abs().max() <= 1e-5 * v.abs().max(), (r, k)
        assert set(out["state"]) == set(want["state"]) == {"a.weight", "a.bias", "b.weight",
                                                           "b.bias"}  # fmt: skip
        for k, v in want["state"].items():
            assert (out["state"][k] - v).abs().max() <= 1e-5 * v.abs().max(), (r, k)


def _zero() -> str:
    import longboat

    try:
        longboat.initialize(Net(), None, _ds_config(2, zero=1))
    except ConfigError as e:
        return str(e)
    return "accepted"


def test_zero_refuses_lamb_naming_the_whole_parameter_norm(ranks):
    for message in ranks(2, _zero):
        assert "strategy 'zero'" in message and "Lamb" in message, message
        assert "norm of each whole parameter" in message, message
