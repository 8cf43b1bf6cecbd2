"""Peak accelerator memory per strategy at a world of one against ``longboat plan``'s prediction,
and ZeRO's optimizer offload to CPU memory beside an accelerator.

Memory: the reference GPT (:func:`longboat.models.reference_gpt`, 21,064,704 parameters) trains
with AdamW in fp32 at micro-batch 8 x 128 tokens, as ``benchmarks/plan_vs_rss.py`` measures it
on the CPU, so the two reports can be read side by side. Per strategy, in one process (the
figures are the allocator's, which frees exactly, unlike a resident set): the peak counter is
reset, the model is built (on the CPU; longboat moves it), trained for a few steps, and the
peak of ``torch.cuda.max_memory_allocated`` above what was allocated before is compared with
the planner's peak for the same model, batch, optimizer and config (planned on fake tensors in
the same process, before, for the device: cuBLAS's workspaces included, each measurement making
its own). ``engine.memory_report()``'s model state is recorded beside the
planner's, and what the peak holds, by where it was made (``gpucheck/allocations.py``).

Offload: ``zero.offload_optimizer.device = 'cpu'`` with the parameters on a GPU (masters and
optimizer state in pinned host memory, [Note: host offload] in ``zero/host.py``): ZeRO-2 trains
the same model with it and then in device memory, and the check records the home built, where
the optimizer's tensors are, and each run's median step time and peak device memory.

Beyond the GPU's memory: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on ``'cpu'``
([Note: host parameter offload] in ``zero/host.py``) trains a GPT whose fp32 state
(parameters, gradients and AdamW's two moments: 16 bytes a parameter) is more than 4 times a cap
set on the process's GPU memory (``torch.cuda.set_per_process_memory_fraction``; the allocator
refuses to go past it), built on the meta device so that no whole copy is ever made; then the
same model without the cap and without offload, in device memory. Each run's median step time
and peak device memory are recorded beside the cap, and the offloaded peak beside
``longboat plan``'s for ``zero-3+cpu`` (and ZeRO-2's offload beside ``zero-2+cpu``'s).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

from gpucheck import allocations
from gpucheck.launch import RankContext, Task

STRATEGIES = ("single", "replicate", "zero-1", "zero-2", "zero-3")
# ZeRO with bf16 parameters ([precision] param_dtype): a bf16 whole copy for compute and fp32
# masters in the optimizer's shard, under bf16 autocast; "+bf16" after a strategy asks for it.
BF16_PARAMS = ("zero-1+bf16", "zero-2+bf16")
GPU_TARGET = {"target": "reference-gpt", "model_args": None, "seq_len": 128, "micro_batch": 8}
DRY_TARGET = {
    "target": "gpt",
    "model_args": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16},
    "seq_len": 16,
    "micro_batch": 2,
}


# The model beyond the cap: 11 blocks of d_model 2048, 570.9M parameters, 9.13 GB of fp32
# state against a 2 GiB cap (4.25x); 2 x 128 tokens a step.
CAP_BYTES = 2 * 2**30
CAP_MODEL = {"vocab_size": 8192, "d_model": 2048, "n_layers": 11, "n_heads": 16, "seq_len": 128}
DRY_CAP_MODEL = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16}
STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient, and AdamW's exp_avg and exp_avg_sq


def tasks(dry: bool) -> list[Task]:
    base = dict(DRY_TARGET if dry else GPU_TARGET, warmup=2, steps=2)
    out = [
        Task(s, "gpucheck.memory:measure", dict(base, strategy=s), 120.0)
        for s in STRATEGIES + BF16_PARAMS
    ]
    out.append(Task("offload-optimizer-cpu", "gpucheck.memory:offload_cpu", dict(base), 90.0))
    cap = {
        "model_args": DRY_CAP_MODEL if dry else CAP_MODEL,
        "cap_bytes": CAP_BYTES,
        "micro_batch": 2,
        "seq_len": 16 if dry else 128,
        "warmup": 1,
        "steps": 3,
    }
    out.append(Task("offload-beyond-the-gpu", "gpucheck.memory:offload_beyond", cap, 240.0))
    return out


def _config(strategy: str, micro_batch: int) -> dict[str, Any]:
    strategy, _, params = strategy.partition("+")
    name, _, stage = strategy.partition("-")
    cfg: dict[str, Any] = {
        "strategy": name,
        "zero": {"stage": int(stage or 1), "unit_classes": ["_Block"]},
        "batch": {"micro_batch_size": micro_batch},
        "log": {"progress": False, "level": "WARNING"},
    }
    if params:
        cfg["precision"] = {"dtype": params, "param_dtype": params}
    return cfg


def _target(args: dict[str, Any]) -> Any:
    from longboat.plan import resolve

    return resolve(args["target"], args["model_args"], seq_len=args["seq_len"])


def _train(engine: Any, vocab: int, args: dict[str, Any], steps: int) -> None:
    from longboat.models import gpt_loss, synthetic_tokens

    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = synthetic_tokens(args["micro_batch"], args["seq_len"], vocab, gen)
        engine.backward(gpt_loss(engine(x.to(engine.device)), y.to(engine.device)))
        engine.step()


def _fresh_peak(device: torch.device) -> int:
    """Collect, free cuBLAS's workspaces, empty the CUDA cache and restart its peak counter;
    the bytes still allocated (0 off CUDA), so a peak read later counts only what came after.
    Every measurement makes its own workspaces, as a fresh process does (the tasks share one):
    the plan counts them ([Note: library workspaces] in ``longboat/plan/device.py``)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _workspaces_made(device: torch.device) -> int | None:
    """Bytes a linear layer's forward and backward leave allocated when nothing of theirs is
    held any more: the workspaces their threads made (None off CUDA)."""
    if device.type != "cuda":
        return None
    before = _fresh_peak(device)
    layer = torch.nn.Linear(64, 64, device=device)
    layer(torch.randn(8, 64, device=device)).sum().backward()
    del layer
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before


def measure(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """The planner's peak, then the measured one, for ``args['strategy']``."""
    import longboat
    from longboat.config import load_config
    from longboat.plan import make_plan

    strategy, micro = args["strategy"], args["micro_batch"]
    cfg = _config(strategy, micro)
    target = _target(args)
    plain_name = strategy.partition("+")[0]
    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    planned = make_plan(
        target, load_config(cfg), 1, micro, "adamw", [plain_name], device=device.type
    ).strategies[0]
    workspaces = _workspaces_made(device)
    before = _fresh_peak(device)
    with allocations.recorded(device) as at_peak:
        torch.manual_seed(0)
        model = target.build()
        engine = longboat.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg)
        _train(engine, model.vocab_size, args, args["warmup"] + args["steps"])
        measured = None
        if cuda:
            torch.cuda.synchronize(device)
            measured = torch.cuda.max_memory_allocated(device) - before
    report = engine.memory_report()
    engine.close()
    del engine, model
    gc.collect()
    return {
        "strategy": strategy,
        "predicted_peak_bytes": planned.peak,
        "predicted": {
            "model_state": planned.model_state,
            "activations": planned.activations,
            "transient": planned.transient,
            "workspaces": planned.workspaces,
        },
        # cuBLAS's, made by a linear layer's forward and backward alone (CUDA only)
        "measured_workspaces": workspaces,
        "measured_peak_bytes": measured,
        "ratio_predicted_over_measured": planned.peak / measured if measured else None,
        "measured_model_state": report.measured,
        "model_state_equal": report.measured == planned.model_state,
        "note": None if cuda else "no CUDA device: the peak is not measured",
        # what the peak holds, by where it was made (gpucheck/allocations.py; CUDA only)
        "at_peak": at_peak or None,
    }


def _planned(target: Any, strategy: str, micro: int, device: torch.device) -> dict[str, Any]:
    """``longboat plan``'s row for ZeRO-Offload (``zero-N+cpu``) at a world of one, for this
    device ([Note: planning host offload] in ``longboat/placement.py``)."""
    from longboat.config import load_config
    from longboat.plan import make_plan

    name, stage = strategy.partition("+")[0].partition("-")[::2]
    base = load_config(_config(f"{name}-{stage}", micro))
    row = make_plan(target, base, 1, micro, "adamw", [strategy], device=device.type).strategies[0]
    return {
        "strategy": strategy,
        "peak_bytes": row.peak,
        "host_bytes": row.host,
        "error": row.error,
    }


def _against(out: dict[str, Any], plan: dict[str, Any]) -> None:
    """The plan beside the offloaded run's measured peak."""
    out["planned_offload"] = plan
    measured = out.get("peak_bytes_offload")
    if measured and plan["peak_bytes"]:
        out["ratio_predicted_over_measured_offload"] = plan["peak_bytes"] / measured


def _timed(engine: Any, vocab: int, args: dict[str, Any], device: torch.device) -> list[float]:
    """Seconds of each of ``warmup + steps`` steps, the device synchronised around each."""
    import time

    times = []
    for _ in range(args["warmup"] + args["steps"]):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        _train(engine, vocab, args, 1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times[args["warmup"] :]


def offload_cpu(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """ZeRO-2 with ``zero.offload_optimizer.device = 'cpu'`` beside this device, then the same
    model in device memory: the home built, where the optimizer's tensors are, each run's median
    step time and peak of ``torch.cuda.max_memory_allocated``."""
    import statistics

    import longboat
    from longboat.config import ConfigError

    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"device": ctx.device, "not_implemented": False}
    for name, offload in (("offload", True), ("in_memory", False)):
        cfg = _config("zero-2", args["micro_batch"])
        if offload:
            cfg["zero"]["offload_optimizer"] = {"device": "cpu"}
        before = _fresh_peak(device)
        torch.manual_seed(0)
        model = _target(args).build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        try:
            engine = longboat.initialize(model, opt, cfg)
        except ConfigError as e:
            return {
                **out,
                "outcome": "refused",
                "not_implemented": "not implemented" in str(e),
                "message": str(e),
            }
        times = _timed(engine, model.vocab_size, args, device)
        if offload:
            out["home"] = type(engine.strategy.home).__name__
            tensors = [p for g in opt.param_groups for p in g["params"]]
            tensors += [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
            out["optimizer_devices"] = sorted({t.device.type for t in tensors})
            out["optimizer_pinned"] = all(t.is_pinned() for t in tensors) if cuda else None
        out[f"median_step_s_{name}"] = statistics.median(times)
        peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
        out[f"peak_bytes_{name}"] = peak
        engine.close()
        del engine, model, opt
    if cuda:
        _against(out, _planned(_target(args), "zero-2+cpu", args["micro_batch"], device))
    out["outcome"] = "trained"
    return out


def offload_beyond(args: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """ZeRO-3 with parameters and optimizer in host memory under a GPU memory cap more than 4x
    below the model's fp32 state, then the same model in device memory without the cap: each
    run's median step time and peak of ``torch.cuda.max_memory_allocated``."""
    import statistics

    import longboat
    from longboat.models import GPT, gpt_param_count

    device = torch.device(ctx.device)
    cuda = device.type == "cuda"
    model_args = args["model_args"]
    params = gpt_param_count(
        model_args["vocab_size"], model_args["d_model"], model_args["n_layers"], args["seq_len"]
    )
    state = STATE_BYTES_PER_PARAM * params
    cap = args["cap_bytes"]
    out: dict[str, Any] = {
        "device": ctx.device,
        "model": dict(model_args, parameters=params),
        "fp32_state_bytes": state,
        "cap_bytes": cap if cuda else None,
        "state_over_cap": state / cap if cuda else None,
        "tokens_per_step": args["micro_batch"] * args["seq_len"],
    }
    host = {"device": "cpu"}
    for name, offload in (("offload", True), ("in_memory", False)):
        cfg = _config("zero-3", args["micro_batch"])
        if offload:
            cfg["zero"].update(offload_param=host, offload_optimizer=host)
        if cuda:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(cap / total if offload else 1.0, device)
        before = _fresh_peak(device)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(**model_args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # What the offloaded run's peak holds, by where it was made, over its setup and first
        # step (recording slows the steps: the timed ones come after)
        recording = allocations.recorded(device) if offload else contextlib.nullcontext({})
        with recording as at_peak:
            engine = longboat.initialize(model, opt, cfg)
            _train(engine, model.vocab_size, args, 1)
        if offload:
            out["home"] = type(engine.strategy.home).__name__
            out["at_peak_offload"] = at_peak or None
        times = _timed(engine, model.vocab_size, args, device)
        out[f"median_step_s_{name}"] = statistics.median(times)
        out[f"step_s_{name}"] = times
        out[f"peak_bytes_{name}"] = (
            torch.cuda.max_memory_allocated(device) - before if cuda else None
        )
        engine.close()
        del engine, model, opt
        gc.collect()
    if cuda:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        out["peak_under_cap"] = out["peak_bytes_offload"] <= cap
        from longboat.plan import resolve

        target = resolve("gpt", model_args, seq_len=args["seq_len"])
        _against(out, _planned(target, "zero-3+cpu", args["micro_batch"], device))
    out["step_ratio_offload_over_in_memory"] = (
        out["median_step_s_offload"] / out["median_step_s_in_memory"]
    )
    out["outcome"] = "trained"
    return out
