"""The default example: a small CNN on scikit-learn's digits (bundled, no download).

    python examples/digits.py                    # one process
    longboat run -n 2 examples/digits.py         # two processes, same global batch
    longboat run -n 2 examples/digits.py --config my.toml

Prints ``accuracy=<test accuracy>`` on rank 0 at the end.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import TensorDataset

import longboat
from longboat.models import DigitsCNN


def data() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return TensorDataset(xtr, ytr), TensorDataset(xte, yte)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).with_name("digits.toml")))
    ap.add_argument("--epochs", type=int, default=15)
    args = ap.parse_args()

    longboat.seed_everything(0)
    train_set, test_set = data()
    model = DigitsCNN()
    engine = longboat.initialize(model, config=args.config)  # optimizer from the config
    loader = engine.loader(train_set)
    loss_fn = torch.nn.CrossEntropyLoss()
    engine.set_total_steps(args.epochs * (len(loader) // engine.accumulation_steps))  # the ETA

    engine.train()
    for _ in range(args.epochs):
        for x, y in loader:
            engine.backward(loss_fn(engine(x), y))
            engine.step()

    engine.eval()
    with torch.no_grad():
        x, y = (t.to(engine.device) for t in test_set.tensors)
        accuracy = (engine(x).argmax(dim=1) == y).float().mean().item()
    if engine.world.is_main:
        print(f"steps={engine.global_step} final_loss={engine.last_loss:.4f}")
        print(f"accuracy={accuracy:.4f}")
    engine.close()


if __name__ == "__main__":
    main()
