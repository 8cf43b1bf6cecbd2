"""Replicated training with in-job recovery: ``train_in_job.py OUT STEPS --kill-rank R
--kill-after K [--model tiny|resnet]``.

A model of tests/reference.py's recipes (TinyNet; or the ResNet, whose BatchNorm buffers are
broadcast after each backward, so that the survivors notice the loss in a backward rather than
in the optimizer step) under strategy 'replicate' with ``recovery.in_job``, one
micro-batch of 2 samples per rank and step, samples in their stored order. Rank R (numbered at
launch) SIGKILLs itself right after step K. Each rank that finishes STEPS writes
``OUT/rank<launch rank>.json`` (per completed step: its rank then, its sample ids and its loss)
and ``OUT/rank<launch rank>.safetensors`` (the model's state and the optimizer's, by parameter
name). No checkpoint is written or read.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: reference

import reference
import torch
from safetensors.torch import save_file

import longboat

SAMPLES = 60


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-after", type=int, default=2)
    ap.add_argument("--model", choices=("tiny", "resnet"), default="tiny")
    args = ap.parse_args()
    torch.set_num_threads(1)  # several ranks share the machine
    model, optimizer, _ = reference.Recipe(args.model, "adamw").build()
    config = {
        "strategy": "replicate",
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "data": {"shuffle": False},
        "log": {"progress": False},
        "comm": {"timeout_s": 10},
        "recovery": {"in_job": True, "wait_s": 10},
    }
    engine = longboat.initialize(model, optimizer, config)
    me = engine.world.rank  # the launch's numbering; engine.world.rank may change
    data = reference.dataset if args.model == "tiny" else reference.image_dataset
    loader = engine.loader(reference.indexed(data(SAMPLES)))
    records = []
    while engine.global_step < args.steps:
        for ids, x, y in loader:
            loss = reference.forward_loss(engine, (x, y))
            engine.backward(loss)
            if not engine.step():
                continue  # a step redone after a regroup (or mid-accumulation)
            step = engine.global_step
            records.append(
                {
                    "step": step,
                    "rank": engine.world.rank,
                    "world": engine.world.world_size,
                    "ids": ids.tolist(),
                    "loss": float(loss.detach()),
                }
            )
            if me == args.kill_rank and step == args.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.steps:
                break
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for p, state in optimizer.state.items():
        for k, v in state.items():
            tensors[f"optim.{names[id(p)]}.{k}"] = torch.as_tensor(v).clone()
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / f"rank{me}.safetensors"))
    (args.out / f"rank{me}.json").write_text(json.dumps(records))
    engine.close()


if __name__ == "__main__":
    main()
