"""Equivalence on the GPU: every strategy and composition the worlds allow, trained by longboat
on every rank, against the plain loop (:mod:`gpucheck.plain`) on rank 0, in fp32.

Three kinds of case, as the CPU suite has them (``tests/test_equivalence.py``,
``test_pipeline.py``, ``test_tensor_parallel.py``):

- ``dp``: ``reference.ZooNet`` (routed experts used on some micro-batches and ranks only, a
  parameter never used, a frozen layer, a weight shared by two modules, BatchNorm, an LSTM,
  sizes that divide neither 2 nor 4), AdamW with weight decay, clipping and a schedule, two
  micro-batches per step, through ``engine.loader``; ranks other than 0 start from other
  weights, which the strategy must replace with rank 0's;
- ``pp``: ``reference.chain_net`` (a layer used on some micro-batches only, with a parameter
  never used; a frozen layer) in pipeline stages through ``engine.train_step``;
- ``tp``: the reference GPT (tied head) with its layers divided by tensor parallelism.

A case passes when every loss and every parameter and buffer is within :data:`TOL` of the
plain loop's (relative, as in the CPU suite) and the model's parameters were on the rank's
device. Each case records the largest absolute and relative differences either way.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gpucheck import plain
from gpucheck.launch import RankContext, Task, WorldSpec
from gpucheck.plain import reference

TOL = 1e-5  # fp32, relative: the suite's tolerance
STEPS = 6
GLOBAL_BATCH = 16
QUIET = {"log": {"progress": False, "level": "WARNING"}}
# A collective that a peer never reaches is reported by longboat itself (naming the rank and
# the collective) well within a case's time limit, instead of being killed without a word.
COMM = {"comm": {"timeout_s": 30.0}}

# Small buckets and per-module units: many buckets and units whose sizes divide no world size
# (as tests/harness.py's ZOO_STRATEGIES).
DP_STRATEGIES: dict[str, dict[str, Any]] = {
    "single": {"strategy": "single"},
    "replicate": {
        "strategy": "replicate",
        "replicate": {"bucket_mb": 0.0005, "first_bucket_mb": 0.0002},
    },
    "zero1": {"strategy": "zero", "zero": {"stage": 1, "bucket_mb": 0.0005}},
    "zero2": {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.0005}},
    "zero3": {
        "strategy": "zero",
        "zero": {"stage": 3, "unit_classes": ["Experts", "LSTM", "BatchNorm1d"]},
    },
}
DP_RECIPE = {"model": "zoo", "optimizer": "adamw", "clip": 1.0, "scheduler": True}
PP_RECIPE = {"model": "chain", "optimizer": "adamw", "clip": 0.5, "scheduler": True}
TP_BATCH, TP_SEQ, TP_CLIP = 8, 8, 0.5


# -- the cases ---------------------------------------------------------------------------------


def _dp(name: str, world: int, extra: dict[str, Any] | None = None) -> Task:
    accum = 2
    cfg = {
        **QUIET,
        **COMM,
        **DP_STRATEGIES[name.removeprefix("hybrid-")],
        "gradient_clipping": DP_RECIPE["clip"],
        "batch": {
            "train_batch_size": GLOBAL_BATCH,
            "micro_batch_size": GLOBAL_BATCH // (world * accum),
        },
        **(extra or {}),
    }
    args = {"recipe": DP_RECIPE, "config": cfg, "steps": STEPS}
    return Task(
        name, "gpucheck.equivalence:train_dp", args, 90.0, "gpucheck.equivalence:compare_dp"
    )


def _pp(name: str, world: int, strategy: dict[str, Any] | None = None) -> Task:
    pp = 2
    accum = 4 if world == pp else 2
    recipe = dict(PP_RECIPE, optimizer="adamw" if world == pp else "sgd")
    cfg = {
        **QUIET,
        **COMM,
        **(strategy or {}),
        "gradient_clipping": recipe["clip"],
        "batch": {
            "train_batch_size": GLOBAL_BATCH,
            "micro_batch_size": GLOBAL_BATCH // (world // pp * accum),
        },
        "mesh": {"pp": pp},
        "pipeline": {"schedule": "1f1b"},
    }
    args = {"recipe": recipe, "config": cfg, "steps": STEPS}
    return Task(
        name, "gpucheck.equivalence:train_pp", args, 90.0, "gpucheck.equivalence:compare_pp"
    )


def _tp(name: str, extra: dict[str, Any]) -> Task:
    cfg = {
        **QUIET,
        **COMM,
        "gradient_clipping": TP_CLIP,
        "batch": {"train_batch_size": TP_BATCH, "gradient_accumulation_steps": 2},
        # SGD: Adam would turn the rounding noise of gradients that are zero in exact
        # arithmetic into steps of the full learning rate (as the CPU suite says)
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        **extra,
    }
    args = {"config": cfg, "steps": STEPS}
    return Task(
        name, "gpucheck.equivalence:train_tp", args, 90.0, "gpucheck.equivalence:compare_tp"
    )


def _two_rank_cases() -> list[Task]:
    return [
        *(_dp(s, 2) for s in ("replicate", "zero1", "zero2", "zero3")),
        _pp("pp2", 2),
        _tp("tp2", {"mesh": {"tp": 2}}),
        _tp("tp2-sequence", {"mesh": {"tp": 2}, "tensor_parallel": {"sequence_parallel": True}}),
    ]


def _four_rank_cases() -> list[Task]:
    zero2 = {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.001}}
    return [
        *(_dp(f"hybrid-zero{s}", 4, {"mesh": {"dp_replicate": 2}}) for s in (1, 2, 3)),
        _pp("pp2xzero2", 4, zero2),
        _tp("tp2xzero2", {"mesh": {"tp": 2}, **zero2}),
    ]


def plan(gpus: int, dry: bool) -> tuple[list[tuple[WorldSpec, list[Task]]], list[dict[str, Any]]]:
    """The worlds to run and their cases, and the cases that cannot run here (with why).

    On a GPU machine: a world of one over NCCL; two and four ranks over gloo with CUDA tensors,
    which may share one GPU; NCCL at 2 and 4 ranks where there are as many GPUs (NCCL takes one
    rank per GPU). Dry (no GPU): the same cases over gloo on the CPU."""
    device = "cpu" if dry else "cuda"
    one = [_dp(s, 1) for s in DP_STRATEGIES]
    worlds: list[tuple[WorldSpec, list[Task]]] = []
    unrunnable: list[dict[str, Any]] = []
    if dry:
        worlds.append((WorldSpec("w1-gloo-cpu", 1, "gloo", device), one))
        worlds.append((WorldSpec("w2-gloo-cpu", 2, "gloo", device), _two_rank_cases()))
        worlds.append((WorldSpec("w4-gloo-cpu", 4, "gloo", device), _four_rank_cases()))
        unrunnable.append(_unrunnable("w2-nccl-one-gpu", "nccl", 2, "no GPU (dry run)"))
        return worlds, unrunnable
    worlds.append((WorldSpec("w1-nccl", 1, "nccl", device), one))
    # gloo moves CUDA tensors itself (through host memory), so ranks may share a GPU.
    worlds.append((WorldSpec("w2-gloo-cuda", 2, "gloo", device), _two_rank_cases()))
    four = (WorldSpec("w4-gloo-cuda", 4, "gloo", device), _four_rank_cases())
    if gpus < 2:
        # NCCL refuses two ranks on one GPU: asked by an all-reduce on an H200 (NCCL 2.28.9),
        # it answered "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device", and
        # longboat refuses such a world by name before NCCL is reached.
        why = "NCCL takes one rank per GPU ('Duplicate GPU detected' otherwise)"
        unrunnable.append(_unrunnable("w2-nccl-one-gpu", "nccl", 2, why))
        worlds.append(four)
        unrunnable.append(_unrunnable("w2-nccl", "nccl", 2, f"{gpus} GPU(s)"))
    else:
        worlds.append(four)
        worlds.append((WorldSpec("w2-nccl", 2, "nccl", device), _two_rank_cases()))
    if gpus >= 4:
        worlds.append((WorldSpec("w4-nccl", 4, "nccl", device), _four_rank_cases()))
    else:
        unrunnable.append(_unrunnable("w4-nccl", "nccl", 4, f"{gpus} GPU(s)"))
    return worlds, unrunnable


def _unrunnable(world: str, backend: str, size: int, why: str) -> dict[str, Any]:
    return {"world": world, "backend": backend, "ranks": size, "status": "skipped", "why": why}


# -- the longboat side, on every rank -----------------------------------------------------------


def _fp32() -> None:
    """fp32 products in fp32 on both sides. With TF32 (cuDNN's default, the LSTM's path) two
    inputs that differ in their last bits, as summing gradients in another order leaves them,
    can round to values 1e-3 apart: a difference of the hardware's rounding, not longboat's."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _initialize(model: nn.Module, opt: Any, cfg: dict[str, Any], sched: Any = None) -> Any:
    import longboat

    _fp32()
    return longboat.initialize(model, opt, cfg, scheduler=sched)


def _perturb(model: nn.Module) -> None:
    """Other weights than rank 0's: the strategy must start every rank from rank 0's."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))


def _where(engine: Any) -> list[str]:
    """The devices the model's parameters are on (the rank's GPU, unless something is off)."""
    return sorted({str(p.device) for p in engine.model.parameters()})


def _state(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in engine.state_dict().items()}


def _zoo_data(n: int) -> Any:
    return reference.zoo_dataset(n)


def _chain_data(n: int) -> Any:
    return reference.indexed(reference.dataset(n))


def train_dp(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """Train the recipe under the config with ``engine.loader``; record which samples each
    micro-batch held, every micro-batch's loss, and the final state."""
    recipe = reference.Recipe(**args["recipe"])
    model, opt, sched = recipe.build()
    if ctx.rank:
        _perturb(model)
    engine = _initialize(model, opt, args["config"], sched)
    steps = args["steps"]
    ids: list[list[list[int]]] = []
    losses: list[list[float]] = []
    step_ids: list[list[int]] = []
    step_losses: list[float] = []
    for batch in engine.loader(_zoo_data(engine.batch.train_batch_size * steps)):
        sample_ids, *rest = batch
        loss = reference.forward_loss(engine, rest)
        engine.backward(loss)
        step_ids.append(sample_ids.tolist())
        step_losses.append(float(loss.detach()))
        if engine.step():
            ids.append(step_ids)
            losses.append(step_losses)
            step_ids, step_losses = [], []
            if engine.global_step == steps:
                break
    out = {"ids": ids, "losses": losses, "state": _state(engine), "devices": _where(engine)}
    engine.close()
    return out


def train_pp(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """Train the chain through pipeline stages with ``engine.train_step``; record each
    micro-batch's samples, the last stage's micro-batch losses, every step's loss and this
    stage's state."""
    recipe = reference.Recipe(**args["recipe"])
    cfg = args["config"]
    model, opt, sched = recipe.build()
    dp = ctx.world_size // cfg["mesh"]["pp"]
    if ctx.rank % dp:
        _perturb(model)
    engine = _initialize(model, opt, cfg, sched)
    coords, mesh = engine.topology.coords, engine.topology.mesh
    micro, accum = engine.batch.micro_batch_size, engine.accumulation_steps
    out: dict[str, Any] = {"ids": [], "losses": [], "step_losses": []}
    out.update(pp=coords["pp"], dp=coords["dp"], last=coords["pp"] == mesh.pp - 1)
    data = _chain_data(engine.batch.train_batch_size * args["steps"])
    for batch in engine.loader(data, per_step=True):
        ids = batch[0]
        micro_losses: list[float] = []

        def loss_fn(output: torch.Tensor, mb: Any, into: list[float] = micro_losses) -> Any:
            loss = nn.functional.cross_entropy(output.float(), mb[2])
            into.append(float(loss.detach()))
            return loss

        out["step_losses"].append(engine.train_step(batch, loss_fn, inputs=lambda mb: (mb[1],)))
        out["ids"].append([ids[i * micro : (i + 1) * micro].tolist() for i in range(accum)])
        out["losses"].append(micro_losses)
        if engine.global_step == args["steps"]:
            break
    out.update(state=_state(engine), devices=_where(engine))
    engine.close()
    return out


def _gpt() -> nn.Module:
    from longboat.models import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=TP_SEQ, tie_weights=True)


def _tp_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        seq = torch.randint(0, 64, (TP_BATCH, TP_SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train_tp(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """Train the GPT with its layers divided; each data-parallel rank takes its share of every
    batch. Records every step's loss and the (whole) state."""
    engine = _initialize(_gpt(), None, args["config"])
    dp = engine.topology.data("dp")
    losses = []
    for b in _tp_batches(args["steps"]):
        mine = tuple(t.chunk(dp.world_size)[dp.rank].to(engine.device) for t in b)
        losses.append(engine.train_step(mine, lambda out, mb: _lm_loss(out, mb[1])))
    out = {"losses": losses, "state": _state(engine), "devices": _where(engine)}
    out["dp"], out["dp_size"] = dp.rank, dp.world_size
    engine.close()
    return out


# -- the comparison, on rank 0 -----------------------------------------------------------------


class _Diffs:
    """The largest differences seen, absolute and relative (as tests/harness.py measures)."""

    def __init__(self) -> None:
        self.loss_abs = self.loss_rel = self.param_abs = self.param_rel = 0.0
        self.notes: list[str] = []

    def loss(self, got: float, want: float) -> None:
        d = abs(got - want)
        if not math.isfinite(d):
            d = math.inf
        self.loss_abs = max(self.loss_abs, d)
        self.loss_rel = max(self.loss_rel, d / max(abs(want), 1.0))

    def state(self, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
        if got.keys() != want.keys():
            self.notes.append(f"state keys differ: {sorted(set(got) ^ set(want))}")
            got = {k: v for k, v in got.items() if k in want}
            want = {k: want[k] for k in got}
        for k, w in want.items():
            g = got[k]
            if g.shape != w.shape:
                self.notes.append(f"{k}: shape {tuple(g.shape)} vs {tuple(w.shape)}")
                self.param_abs = self.param_rel = math.inf
                continue
            if not w.is_floating_point():
                if not torch.equal(g, w):
                    self.notes.append(f"{k}: {g.tolist()} vs {w.tolist()}")
                continue
            if not w.numel():
                continue
            d = float((g.double() - w.double()).abs().max())
            if not math.isfinite(d):
                d = math.inf
            self.param_abs = max(self.param_abs, d)
            self.param_rel = max(self.param_rel, d / max(float(w.abs().max()), 1e-12))

    def outcome(self, ctx: RankContext, results: list[dict[str, Any]]) -> dict[str, Any]:
        devices = sorted({d for r in results for d in r["devices"]})
        want = "cuda" if ctx.device.startswith("cuda") else "cpu"
        on_device = all(d.startswith(want) for d in devices)
        if not on_device:
            self.notes.append(f"parameters on {devices}, expected {want}")
        passed = self.loss_rel <= TOL and self.param_rel <= TOL and not self.notes
        return {
            "passed": passed,
            "max_abs_loss_diff": self.loss_abs,
            "max_rel_loss_diff": self.loss_rel,
            "max_abs_param_diff": self.param_abs,
            "max_rel_param_diff": self.param_rel,
            "tolerance_rel": TOL,
            "parameter_devices": devices,
            "notes": self.notes,
        }


def compare_dp(
    args: dict[str, Any], ctx: RankContext, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """Replay the samples every rank saw through the plain loop on this rank's device; compare
    every micro-batch's loss on every rank and every rank's final state."""
    _fp32()
    steps = len(results[0]["ids"])
    micros = len(results[0]["ids"][0])
    order = [[[r["ids"][s][t] for r in results] for t in range(micros)] for s in range(steps)]
    recipe = reference.Recipe(**args["recipe"])
    want = plain.train_in_rank_order(
        recipe, _zoo_data(GLOBAL_BATCH * args["steps"]), order, ctx.device
    )
    diffs = _Diffs()
    if steps != args["steps"]:
        diffs.notes.append(f"trained {steps} steps, asked {args['steps']}")
    for r, res in enumerate(results):
        for s, step in enumerate(res["losses"]):
            for t, loss in enumerate(step):
                diffs.loss(loss, want["losses"][s][t][r])
        diffs.state(res["state"], want["state"])
    return diffs.outcome(ctx, results)


def compare_pp(
    args: dict[str, Any], ctx: RankContext, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """The plain loop over the samples of the first stage's ranks; every rank's step loss, the
    last stage's micro-batch losses, and the stages' states together."""
    _fp32()
    first = sorted((r for r in results if r["pp"] == 0), key=lambda r: r["dp"])
    steps, accum = len(first[0]["ids"]), len(first[0]["ids"][0])
    order = [[[r["ids"][s][t] for r in first] for t in range(accum)] for s in range(steps)]
    recipe = reference.Recipe(**args["recipe"])
    want = plain.train_in_rank_order(
        recipe, _chain_data(GLOBAL_BATCH * args["steps"]), order, ctx.device
    )
    diffs = _Diffs()
    for r in results:
        if r["ids"] != first[r["dp"]]["ids"]:
            diffs.notes.append(f"stage {r['pp']} of data-parallel rank {r['dp']} saw other samples")
        for s in range(steps):
            plain_losses = [want["losses"][s][t][r["dp"]] for t in range(accum)]
            diffs.loss(r["step_losses"][s], sum(plain_losses) / accum)
            if r["last"]:
                for got, w in zip(r["losses"][s], plain_losses, strict=True):
                    diffs.loss(got, w)
        diffs.state(r["state"], {k: want["state"][k] for k in r["state"] if k in want["state"]})
    held = set().union(*(r["state"] for r in results))
    if held != set(want["state"]):
        diffs.notes.append(f"no stage holds {sorted(set(want['state']) - held)}")
    return diffs.outcome(ctx, results)


def compare_tp(
    args: dict[str, Any], ctx: RankContext, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """The plain loop over whole batches in the micro-batches each data-parallel rank used;
    the mean over data-parallel ranks of their step losses, and every rank's whole state."""
    _fp32()
    dp = results[0]["dp_size"]
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want = plain.train_micro_batches(
        model, opt, _tp_batches(args["steps"]), TP_BATCH // (2 * dp), TP_CLIP, _lm_loss, ctx.device
    )
    diffs = _Diffs()
    by_dp: dict[int, list[float]] = {}
    for r in results:
        by_dp.setdefault(r["dp"], r["losses"])
        if r["losses"] != by_dp[r["dp"]]:
            diffs.notes.append("tensor-parallel ranks of one data-parallel rank disagree on loss")
        diffs.state(r["state"], want["state"])
    for s, w in enumerate(want["losses"]):
        diffs.loss(sum(losses[s] for losses in by_dp.values()) / dp, w)
    return diffs.outcome(ctx, results)


# -- records -----------------------------------------------------------------------------------


def case_record(world: WorldSpec, task: Task, rec: dict[str, Any]) -> dict[str, Any]:
    """One case as the results file lists it: its world, what it ran, and how it ended:
    ``pass``, ``fail`` (ran, but differs), ``error`` (raised, died or timed out) or
    ``skipped``."""
    out: dict[str, Any] = {
        "case": task.name,
        "world": world.name,
        "ranks": world.size,
        "backend": world.backend,
        "device": world.device,
        "shared_gpu": world.share_gpu,
        "seconds": rec["seconds"],
    }
    result = rec.get("result") or {}
    if rec["status"] == "ok":
        out["status"] = "pass" if result.get("passed") else "fail"
        out.update(result)
    else:
        out["status"] = "skipped" if rec["status"] == "skipped" else "error"
        out["error"] = rec.get("error")
        if rec["status"] == "timeout":
            out["timed_out"] = True
        if rec.get("logs"):
            out["logs"] = rec["logs"]
    out["recipe"] = task.args.get("recipe")  # the tensor-parallel cases train the GPT
    out["config"] = task.args.get("config")
    return out
