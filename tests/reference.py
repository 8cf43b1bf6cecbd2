"""Shared pieces of the equivalence tests: a small model, a data set and a training loop that
runs unchanged in a single process (the reference) and on every rank of a pool."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import longboat


class TinyNet(nn.Module):
    """An MLP with a LayerNorm and a tied input/output projection (tied parameters)."""

    def __init__(self, d_in: int = 12, d_hidden: int = 24, n_out: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.mid = nn.Linear(d_hidden, d_hidden)
        self.out = nn.Linear(d_hidden, n_out)
        self.frozen = nn.Linear(d_hidden, d_hidden)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = torch.tanh(self.mid(h)) + 0.1 * self.frozen(h)
        return self.out(h)


class TiedNet(nn.Module):
    """Two Linear modules sharing one weight (tied parameters across modules), odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 12, bias=False)
        self.mid = nn.Linear(12, 7)
        self.back = nn.Linear(7, 12)
        self.head = nn.Linear(12, 12)
        self.head.weight = self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        h = torch.tanh(self.back(torch.tanh(self.mid(h))))
        return self.head(h)


MODELS = {"tiny": TinyNet, "tied": TiedNet}


def dataset(n: int, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = torch.randint(0, 12, (n,), generator=g)
    return TensorDataset(x, y)


def train(config: dict[str, Any], steps: int, optimizer: str = "sgd",
          perturb_rank: bool = True, model_name: str = "tiny") -> dict[str, torch.Tensor]:
    """Train a test model for ``steps`` optimizer steps; return its final state (CPU tensors)."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if perturb_rank and rank:
        with torch.no_grad():  # the strategy must start every rank from rank 0's weights
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    opt = (torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    config = {"log": {"progress": False, "level": "WARNING"}, **config}
    engine = longboat.initialize(model, opt, config)
    n = engine.batch.train_batch_size * steps
    loader = engine.loader(dataset(n))
    loss_fn = nn.CrossEntropyLoss()
    done = 0
    while done < steps:
        for x, y in loader:
            engine.backward(loss_fn(engine(x), y))
            done += engine.step()
            if done == steps:
                break
    state = {k: v.detach().clone() for k, v in engine.state_dict().items()}
    engine.close()
    return state


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"keys differ: {set(a) ^ set(b)}"
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)
