"""A small training script for ``longboat tune SCRIPT``: ``tune_train.py [STEPS]``.

It trains a tiny MLP on random regression batches whose sizes come from the engine (so each
candidate's micro-batch and accumulation are the ones it runs), through ``engine.train_step``
(so a candidate with pipeline stages runs too), for STEPS steps (default: many; ``longboat
tune`` stops it after its own budget). ``build_model`` and ``example_input`` at the top level
let ``--plan-model tune_train:build_model`` plan it; the training runs only as a script.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import longboat

IN, OUT = 8, 4


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 32), nn.GELU(), nn.Linear(32, OUT))


def example_input(_model: nn.Module, micro_batch: int) -> torch.Tensor:
    return torch.zeros(micro_batch, IN)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    torch.set_num_threads(1)  # several ranks share the machine
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The script's own config; longboat tune sets each candidate's keys over it.
    engine = longboat.initialize(model, opt, config={"batch": {"train_batch_size": 16}})
    share = engine.batch.micro_batch_size * engine.accumulation_steps
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(share, IN, generator=gen), torch.randn(share, OUT, generator=gen)
        engine.train_step((x, y), lambda out, mb: F.mse_loss(out, mb[1]))
    engine.close()


if __name__ == "__main__":
    main()
