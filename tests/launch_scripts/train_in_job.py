"""Replicated training with in-job recovery: ``train_in_job.py OUT STEPS --kill-rank R
--kill-after K [--kill R:K ...] [--model tiny|resnet] [--wait-joiner] [--timeout-s S]
[--zero-stage S]`` (``comm.timeout_s``, 10 s by default).

A model of tests/reference.py's recipes (TinyNet; or the ResNet, whose BatchNorm buffers are
broadcast after each backward, so that the survivors notice the loss in a backward rather than
in the optimizer step) under strategy 'replicate' with ``recovery.in_job``, one
micro-batch of 2 samples per rank and step, samples in their stored order. Rank R (numbered at
launch) SIGKILLs itself right after step K (each ``--kill R:K`` adds one; a replacement that
``longboat run --max-restarts`` started in a killed rank's place does not kill itself). With
``--wait-joiner``, while the world is smaller than at launch, each rank waits after every step
until the replacements have started (each writes ``OUT/started.<id>`` before it builds its
engine), then 1 s more, so that a replacement has steps to join at. Each rank that finishes
STEPS writes ``OUT/rank<launch rank>.json`` (per completed step: the rank and world size that
trained it, its sample ids and its loss) and ``OUT/rank<launch rank>.safetensors`` (the model's
state and the optimizer's, by parameter name). No checkpoint is written or read.

With ``--zero-stage S``: strategy 'zero' at stage S over hybrid sharding, two replicas
(``mesh.dp_replicate = 2``), each sharded over half the ranks; with ``--in-average
after-vote|before-vote`` rank R kills itself inside step K + 1 instead, as it starts averaging
its gradient shards with the other replica (its shard group's reductions over, its peers'
averages free to complete without it), after the step's usage vote over every rank completed
or with it still in flight. The model's state is saved whole
(``engine.state_dict()``), the optimizer's as this rank's pieces: ``piece.<name>.<key>.<start>.
<end>`` (flat ranges of the full tensor), ``shape.<name>.<key>`` and ``scalar.<name>.<key>``.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: reference

import reference
import torch
from safetensors.torch import save_file

import longboat

SAMPLES = 60


def _wait_for_replacements(out: Path, missing: int) -> None:
    """Hold this step boundary until as many replacements as ranks are missing have started
    (at most 180 s: a busy machine starts a process slowly), then give them 1 s per step to
    build their engines and ask to be taken in."""
    deadline = time.monotonic() + 180
    while len(list(out.glob("started.*"))) < missing and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)


def _die_in_average(engine, after: int, vote: bool) -> None:
    """SIGKILL this rank at its first average across replicas in step ``after`` + 1 (a fault
    injected into ZeRO's reduction: the doorway of its replica group); ``vote``: once the
    step's usage vote over every rank is over, else with it still in flight."""
    replicas = engine.strategy._reduction.replicas
    average = replicas.all_reduce

    def dying(*args, **kwargs):
        if engine.global_step == after:
            if vote:  # else the vote, never complete, keeps the others from their steps
                engine.strategy._reduction._usage_handle.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return average(*args, **kwargs)

    replicas.all_reduce = dying


def _sharded_state(engine) -> dict:
    """ZeRO: the whole model (every rank calls it), and this rank's optimizer pieces."""
    tensors = {f"model.{k}": v.detach().clone() for k, v in engine.state_dict().items()}
    state = engine.strategy.checkpoint_state(engine.model, engine.optimizer)
    for p in state.pieces:
        if p.key == "model":
            continue
        key = f"{p.name}.{p.key.removeprefix('optim.')}"
        tensors[f"piece.{key}.{p.start}.{p.end}"] = p.tensor.detach().clone().reshape(-1)
        tensors[f"shape.{key}"] = torch.tensor(list(p.shape), dtype=torch.int64)
    for name, scalars in state.scalars.items():
        for k, v in scalars.items():
            value = v["value"] if isinstance(v, dict) else v
            tensors[f"scalar.{name}.{k}"] = torch.as_tensor(value).clone()
    return tensors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--kill-after", type=int, default=2)
    ap.add_argument("--kill", action="append", default=[])
    ap.add_argument("--model", choices=("tiny", "resnet"), default="tiny")
    ap.add_argument("--wait-joiner", action="store_true")
    ap.add_argument("--samples", type=int, default=SAMPLES)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--in-average", choices=("after-vote", "before-vote"))
    args = ap.parse_args()
    kills = {(args.kill_rank, args.kill_after)}
    kills |= {(int(r), int(k)) for r, k in (x.split(":") for x in args.kill)}
    replacement = "LONGBOAT_REPLACEMENT_ID" in os.environ
    torch.set_num_threads(1)  # several ranks share the machine
    if replacement:  # the others wait for this file before they go on at the smaller size
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"started.{os.environ['LONGBOAT_REPLACEMENT_ID']}").touch()
    model, optimizer, _ = reference.Recipe(args.model, "adamw").build()
    config = {
        "strategy": "replicate",
        "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 1},
        "data": {"shuffle": False},
        "log": {"progress": False},
        "comm": {"timeout_s": args.timeout_s},
        "recovery": {"in_job": True, "wait_s": 10},
    }
    if args.zero_stage:
        config |= {"strategy": "zero", "zero": {"stage": args.zero_stage}}
        config["mesh"] = {"dp_replicate": 2}
    engine = longboat.initialize(model, optimizer, config)
    if args.in_average and not replacement and int(os.environ["RANK"]) == args.kill_rank:
        _die_in_average(engine, args.kill_after, args.in_average == "after-vote")
    me = int(os.environ["RANK"])  # the launch's numbering; engine.world.rank may change
    launched = int(os.environ["WORLD_SIZE"])
    data = reference.dataset if args.model == "tiny" else reference.image_dataset
    loader = engine.loader(reference.indexed(data(args.samples)))
    records = []
    while engine.global_step < args.steps:
        for ids, x, y in loader:
            loss = reference.forward_loss(engine, (x, y))
            engine.backward(loss)
            # The group that trained this step: a replacement taken in at its end (inside
            # step()) counts from the next one.
            rank, world = engine.world.rank, engine.world.world_size
            if not engine.step():
                continue  # a step redone after a regroup (or mid-accumulation)
            step = engine.global_step
            records.append(
                {
                    "step": step,
                    "rank": rank,
                    "world": world,
                    "ids": ids.tolist(),
                    "loss": float(loss.detach()),
                }
            )
            if not replacement and not args.in_average and (me, step) in kills:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.wait_joiner and engine.world.world_size < launched:
                _wait_for_replacements(args.out, launched - engine.world.world_size)
            if step == args.steps:
                break
    if args.zero_stage:
        tensors = _sharded_state(engine)
    else:
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
