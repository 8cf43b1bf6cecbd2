"""Step time of longboat's tensor parallelism against torch's own ``parallelize_module``.

Both sides train the same transformers ``LlamaForCausalLM`` (built from a config, separate q, k
and v projections, so torch's stock ``ColwiseParallel``/``RowwiseParallel`` styles are right
for it) at ``tp`` = the world size, with the same layers divided the same way: q, k, v, gate and
up column-wise, o and down row-wise; embeddings, norms and the LM head whole on every rank.
Every rank feeds the same global batch, as tensor parallelism wants.

Each side runs in fresh process pairs: round r starts one job for one side, then one for the
other (the order flips every round, ABBA), each doing a few unmeasured steps and then the
measured ones. One step is forward, loss, backward, AdamW step, zero_grad; each rank times its
own step with ``time.perf_counter`` and the ranks take the MAX, outside the timed region. Every
job starts from the same weights and data, so step k's loss must agree between the sides (the
report gives the largest difference: a wrong split would show there, not in the timing).

Usage::

    python benchmarks/tp_vs_torch.py           # writes benchmarks/results/tp_vs_torch.json

Measure with nothing else running on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import fresh_job, join_loopback, machine, versions
from torch import nn

SIDES = ("longboat", "torch")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "tp_vs_torch.json"
LAYERS = "model.layers.*"
COLWISE = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks = tp degree")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (every rank)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4, help="grouped-query attention")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per job")
    p.add_argument("--steps", type=int, default=8, help="measured steps per job")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs both sides once")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 3 or args.rounds < 1:
        p.error("need --warmup >= 1, --steps >= 3 and --rounds >= 1")
    return args


def _model(args: argparse.Namespace) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def _longboat(model: nn.Module, args: argparse.Namespace) -> tuple[Any, torch.optim.Optimizer]:
    import longboat

    plan = {f"{LAYERS}.{m}": "colwise" for m in COLWISE}
    plan |= {f"{LAYERS}.{m}": "rowwise" for m in ROWWISE}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    engine = longboat.initialize(
        model,
        opt,
        config={
            "mesh": {"tp": args.world_size},
            "tensor_parallel": {"plan": plan},
            "batch": {"micro_batch_size": args.batch},
            "log": {"progress": False, "level": "WARNING"},
        },
    )
    return engine, opt


def _torch(model: nn.Module, args: argparse.Namespace) -> tuple[Any, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (args.world_size,))
    plan: dict[str, Any] = {}
    for i in range(args.layers):
        plan |= {f"model.layers.{i}.{m}": ColwiseParallel() for m in COLWISE}
        plan |= {f"model.layers.{i}.{m}": RowwiseParallel() for m in ROWWISE}
    parallelize_module(model, mesh, plan)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def _job(rank: int, side: str, args: argparse.Namespace, port: int, out: str) -> None:
    join_loopback(rank, args.world_size, port, args.threads)
    try:
        model = _model(args)
        engine, opt = (_longboat if side == "longboat" else _torch)(model, args)
        gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches on every rank
        times: list[float] = []
        losses: list[float] = []
        for k in range(args.warmup + args.steps):
            x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=gen)
            inputs, target = x[:, :-1], x[:, 1:]
            t0 = time.perf_counter()
            logits = engine(inputs).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
            if side == "longboat":
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            losses.append(loss.item())
            if k >= args.warmup:
                times.append(elapsed.item())
        # What this rank holds of one divided weight: half the rows at tp = 2 on both sides.
        q = model.get_submodule("model.layers.0.self_attn.q_proj").weight
        local = q.to_local() if hasattr(q, "to_local") else q
        if side == "longboat":
            engine.close()
        if rank == 0:
            job = {"times": times, "losses": losses, "q_proj_local_shape": list(local.shape)}
            Path(out).write_text(json.dumps(job))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    jobs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
    for r in range(args.rounds):
        order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            jobs[side].append(fresh_job(_job, args.world_size, side, args))
            med = statistics.median(jobs[side][-1]["times"])
            print(f"round {r} {side}: median step {med:.4f} s", flush=True)
    per_round = {s: [statistics.median(j["times"]) for j in jobs[s]] for s in SIDES}
    medians = {s: statistics.median(v) for s, v in per_round.items()}
    paired = [a / b for a, b in zip(per_round["longboat"], per_round["torch"], strict=True)]
    loss_diff = max(
        abs(a - b)
        for ja, jb in zip(jobs["longboat"], jobs["torch"], strict=True)
        for a, b in zip(ja["losses"], jb["losses"], strict=True)
    )
    params = sum(p.numel() for p in _model(args).parameters())
    result = {
        "benchmark": "tp_vs_torch",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "what": "step time of longboat's tensor parallelism vs torch parallelize_module "
        "(ColwiseParallel/RowwiseParallel), same model, same layers divided, fresh process "
        "pairs alternating ABBA",
        "config": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "model": "transformers LlamaForCausalLM",
            "parameters": params,
            "colwise": list(COLWISE),
            "rowwise": list(ROWWISE),
        },
        "versions": versions("transformers"),
        "machine": machine(),
        "median_step_s": medians,
        "per_round_median_step_s": per_round,
        "ratio_longboat_over_torch": medians["longboat"] / medians["torch"],
        "paired_ratio_median": statistics.median(paired),
        "paired_ratios": paired,
        "max_abs_loss_diff": loss_diff,
        "losses_first_job": {s: jobs[s][0]["losses"] for s in SIDES},
        "q_proj_local_shape": {s: jobs[s][0]["q_proj_local_shape"] for s in SIDES},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"median step: longboat {medians['longboat']:.4f} s, torch {medians['torch']:.4f} s; "
        f"ratio (longboat / torch) = {result['ratio_longboat_over_torch']:.3f}, paired "
        f"{result['paired_ratio_median']:.3f}; max |loss diff| {loss_diff:.2e}; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
