"""The reference GPT on synthetic next-token data, trained with ``engine.train_step``, so that
the same script runs data parallel or in pipeline stages by changing only the config.

    longboat run -n 2 examples/gpt.py                                  # replicate over 2 ranks
    longboat run -n 2 examples/gpt.py --config examples/gpt_pp2.toml   # 2 pipeline stages

Prints ``steps=<n> final_loss=<loss>`` on rank 0 at the end: the last step's loss over its
whole batch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import longboat
from longboat.models import gpt_loss, reference_gpt, synthetic_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).with_name("gpt.toml")))
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    longboat.seed_everything(0)
    model = reference_gpt()
    # With pipeline stages, the layers are timed on one micro-batch (4 samples in
    # gpt_pp2.toml) and split so that the slowest stage is as fast as it can be.
    example = synthetic_tokens(4, model.seq_len, model.vocab_size, torch.Generator())[0]
    # the optimizer comes from the config
    engine = longboat.initialize(model, config=args.config, example_input=example)
    n = engine.batch.train_batch_size * args.steps
    x, y = synthetic_tokens(n, model.seq_len, model.vocab_size, torch.Generator().manual_seed(0))
    loader = engine.loader(TensorDataset(x, y), per_step=True)  # a whole step's samples at a time
    engine.set_total_steps(args.steps)

    engine.train()
    for batch in loader:
        engine.train_step(batch, lambda logits, mb: gpt_loss(logits, mb[1]))
        if engine.global_step == args.steps:
            break
    # Each data-parallel rank saw its own samples (pipeline stages share theirs): the mean over
    # every rank is the loss of the whole step's batch, comparable across layouts.
    loss = torch.tensor([engine.last_loss], dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(loss)
        loss /= torch.distributed.get_world_size()
    if engine.world.is_main:
        print(f"steps={engine.global_step} final_loss={loss.item():.6f}")
    engine.close()


if __name__ == "__main__":
    main()
