"""``longboat plan``: its model-state bytes equal engine.memory_report() on real ranks, byte for
byte; its CLI; and that planning allocates nothing (a billion parameters in small memory)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import TinyNet
from typer.testing import CliRunner

from longboat.cli import app
from longboat.comm.collectives import Collectives
from longboat.comm.protocol import Comm
from longboat.config import load_config
from longboat.models import GPT, gpt_loss, gpt_param_count, synthetic_tokens
from longboat.pipeline.p2p import HEADER_BYTES
from longboat.plan import Plan, StrategyPlan, Target, make_plan, render, resolve
from longboat.plan.planner import CATEGORIES, OPTIMIZERS, strategy_config
from longboat.plan.simulate import MetaCollectives, simulate
from longboat.plan.tracker import LiveBytes

# Odd sizes: no unit's element count divides by 2, so every shard is padded.
GPT_ARGS = {"vocab_size": 509, "d_model": 27, "n_layers": 2, "n_heads": 3, "seq_len": 13}
MICRO = 3


def _config(strategy: str, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    name, _, stage = strategy.partition("-")
    zero: dict[str, Any] = {"stage": int(stage or 1), "bucket_mb": 0.01}  # several units
    if model == "gpt":
        zero["unit_classes"] = ["_Block"]
    else:
        zero["unit_min_params"] = 100
    return {
        "strategy": name,
        "zero": zero,
        "replicate": {"bucket_mb": 0.01},
        "batch": {"micro_batch_size": MICRO},
        "log": {"progress": False, "level": "WARNING"},
        **extra,
    }


def _build(model: str) -> torch.nn.Module:
    return GPT(**GPT_ARGS) if model == "gpt" else TinyNet()


def _tiny_target() -> Target:
    return Target(
        "tiny", TinyNet, lambda _m, b: (torch.zeros(b, 12),), lambda out, _a: out.float().mean()
    )


def _measured(strategy: str, model: str, optimizer: str, extra: dict[str, Any]) -> dict[str, int]:
    """One real step on this rank; memory_report's measured bytes."""
    import longboat

    torch.manual_seed(0)
    net = _build(model)
    params = [p for p in net.parameters() if p.requires_grad]
    engine = longboat.initialize(
        net, OPTIMIZERS[optimizer](params), _config(strategy, model, extra)
    )
    if model == "gpt":
        x, y = synthetic_tokens(
            MICRO, GPT_ARGS["seq_len"], GPT_ARGS["vocab_size"], torch.Generator().manual_seed(1)
        )
        loss = gpt_loss(engine(x), y)
    else:
        loss = engine(torch.randn(MICRO, 12)).mean()
    engine.backward(loss)
    engine.step()
    measured = engine.memory_report().measured
    engine.close()
    return measured


CASES = [
    ("replicate", "gpt", "adamw", {}),
    ("zero-1", "gpt", "adamw", {}),
    ("zero-2", "gpt", "adamw", {}),
    ("zero-3", "gpt", "adamw", {}),
    ("replicate", "tiny", "sgd-momentum", {"precision": {"communication_data_type": "bf16"}}),
    ("zero-2", "tiny", "adam", {}),
    ("zero-3", "tiny", "sgd", {}),
    ("zero-3", "gpt", "adamw", {"precision": {"dtype": "bf16"}}),
]


@pytest.mark.parametrize(("strategy", "model", "optimizer", "extra"), CASES)
def test_model_state_equals_memory_report_at_two_ranks(ranks, strategy, model, optimizer, extra):
    target = resolve("gpt", GPT_ARGS) if model == "gpt" else _tiny_target()
    base = load_config(_config(strategy, model, extra))
    plan = make_plan(target, base, 2, MICRO, optimizer, [strategy])
    for rank, measured in enumerate(ranks(2, _measured, strategy, model, optimizer, extra)):
        # Each rank's own plan: ZeRO's ranks differ by padding and per-parameter scalars.
        predicted = (
            make_plan(target, base, 2, MICRO, optimizer, [strategy], rank=rank)
            .strategies[0]
            .model_state
        )
        assert predicted == measured, f"rank {rank}: plan {predicted} != measured {measured}"
    if model == "gpt" and strategy != "replicate":  # odd sizes: padding is counted too
        a = plan.trainable_params
        assert plan.strategies[0].model_state["gradients"] > (
            4 * a // 2 if strategy != "zero-1" else 4 * a
        )


def test_single_model_state_equals_memory_report(ranks):
    target = resolve("gpt", GPT_ARGS)
    plan = make_plan(
        target, load_config(_config("single", "gpt", {})), 1, MICRO, "adamw", ["single"]
    )
    [measured] = ranks(1, _measured, "single", "gpt", "adamw", {})
    assert plan.strategies[0].model_state == measured


def _ps_measured(extra: dict[str, Any]) -> dict[str, Any]:
    """A parameter-server rank after one real step: a worker's memory_report, or what a
    server held."""
    import longboat

    try:
        return {"worker": _measured("parameter_server", "gpt", "adamw", extra)}
    except longboat.ps.ServerExit as served:
        return {"server": served.summary["memory"]}


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_parameter_server_rows_equal_a_real_run(ranks, mode):
    # 2 workers and 2 servers: the key (every parameter) is split between the servers.
    extra = {"parameter_server": {"servers": 2, "mode": mode}}
    target = resolve("gpt", GPT_ARGS)
    base = load_config(_config("parameter_server", "gpt", extra))
    plan = make_plan(target, base, 4, MICRO, "adamw", ["parameter_server"])
    rows = {s.role: s for s in plan.strategies}
    assert list(rows) == ["worker", "server 0", "server 1"]
    real = ranks(4, _ps_measured, extra)
    for res in real[:2]:
        assert rows["worker"].model_state == res["worker"]
    assert rows["worker"].model_state["optimizer_state"] == 0  # it lives on the servers
    for s, res in enumerate(real[2:]):
        state = rows[f"server {s}"].model_state
        kept = {k: state[k] for k in ("parameters", "optimizer_state")}
        assert kept == res["server"], f"server {s}"
        assert state["parameters"] > 0
        # the pushes a server may hold summed: one clock in sync, staleness + 1 in ssp
        held = 1 if mode == "sync" else 3
        flags = state["gradients"] - held * state["parameters"]  # a float per segment
        assert 0 < flags < 100 * held, state
    # every worker's push and pull pass through the servers: a server moves, per step, what
    # each worker sends of its range, and a worker pushes and pulls the whole model once
    whole = 4 * plan.trainable_params
    push = rows["worker"].comm_bytes["push"]
    assert whole < push < whole + 1000
    moved = sum(rows[f"server {s}"].comm_bytes["push (received)"] for s in range(2))
    assert moved == 2 * push


@contextlib.contextmanager
def _reductions_held_to_their_wait() -> Iterator[None]:
    """ZeRO lands each reduction when the step waits for it, as the plan assumes, instead of
    as soon as it is over (``_reap`` during backward), which depends on how fast the peers are:
    the plan is then the peak; with reaping, an upper bound of it
    (:func:`test_a_real_peak_with_early_landings_stays_under_the_plan`)."""
    from longboat.strategies.zero import reduce as zero

    completed = zero._completed
    zero._completed = lambda handle: False
    try:
        yield
    finally:
        zero._completed = completed


@contextlib.contextmanager
def _landings_after_gloo_lets_go() -> Iterator[list[str]]:
    """Each landing returns once the buffers it drops are freed. gloo's worker thread marks a
    work completed, then drops its own reference to the work and so to the work's tensors: for
    a moment after ``is_completed()`` and ``wait()`` the input and output of a reduction that
    just landed are still alive (2-3% of landings on this machine). That moment is not the
    plan's to predict; without this, a landing in it while the backward's peak builds adds a
    unit's buffer to the measured peak (CI once saw 63 KB over the plan). Yields the units
    whose buffers something else still held 5 s after their landing."""
    import time
    import weakref

    from longboat.strategies.zero.in_memory import InMemory

    land = InMemory.land
    still_held: list[str] = []

    def landed(home: Any, u: Any) -> None:
        before = [t for t in (u.flat_grad, u.reduced) if t is not None]
        refs = [weakref.ref(t.untyped_storage()) for t in before]
        del before
        land(home, u)
        kept = {id(t.untyped_storage()) for t in (u.flat_grad, u.grad_shard) if t is not None}
        deadline = time.monotonic() + 5.0
        for ref in refs:
            while (st := ref()) is not None and id(st) not in kept:
                del st
                if time.monotonic() > deadline:
                    still_held.append(u.tag)  # the peak then shows it
                    return
                time.sleep(0)

    InMemory.land = landed  # type: ignore[method-assign]
    try:
        yield still_held
    finally:
        InMemory.land = land  # type: ignore[method-assign]


def _live_peak(strategy: str, extra: dict[str, Any]) -> tuple[int, int]:
    """The live-tensor peak of a real run (setup and two steps), by the planner's tracker, and
    the largest ZeRO unit shard's bytes (0 for other strategies)."""
    import longboat

    tracker = LiveBytes()
    with tracker, _reductions_held_to_their_wait(), _landings_after_gloo_lets_go():
        torch.manual_seed(0)
        net = GPT(**GPT_ARGS)
        # Without the desync check: each asynchronous collective in flight holds its
        # fingerprint exchange (a few hundred bytes), and how many are in flight at the peak
        # depends on when the reductions finish. The plan leaves control traffic out.
        cfg = {**_config(strategy, "gpt", extra), "comm": {"desync_check": False}}
        engine = longboat.initialize(net, OPTIMIZERS["adamw"](net.parameters()), cfg)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = synthetic_tokens(MICRO, GPT_ARGS["seq_len"], GPT_ARGS["vocab_size"], gen)
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
        units = getattr(engine.strategy, "units", [])
        shard = max((u.shard_numel * u.dtype.itemsize for u in units), default=0)
        engine.close()
    return tracker.max_peak, shard


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [
        ("replicate", {}),
        ("zero-1", {}),
        ("zero-2", {}),
        ("zero-3", {}),
        ("zero-3", {"precision": {"dtype": "bf16"}}),
    ],
)
def test_peak_equals_the_live_tensor_peak_of_a_real_run(ranks, strategy, extra):
    plan = make_plan(
        resolve("gpt", GPT_ARGS),
        load_config(_config(strategy, "gpt", extra)),
        2,
        MICRO,
        "adamw",
        [strategy],
    )
    predicted = plan.strategies[0].peak
    for rank, (real, shard) in enumerate(ranks(2, _live_peak, strategy, extra)):
        # The real run's batches are drawn as one sequence of seq_len + 1 and sliced
        # (synthetic_tokens): a few hundred bytes the planner's zeros do not have. Besides,
        # gloo's reduce-scatter stages its input in a copy ([Note: gloo staging]) that this
        # tracker sees only from the wait; whether a landing falls at the peak depends on when
        # the reductions finish (seen once in 16 runs on a loaded machine).
        # test_zero_peak_counts_gloo_staging_and_equals_the_real_peak counts it from the issue.
        assert -1024 <= real - predicted <= 1024 + shard, (
            f"rank {rank}: plan {predicted}, real {real}"
        )


class _StagedLiveBytes(LiveBytes):
    """The planner's tracker on a real gloo run, counting each reduce-scatter's staging copy of
    its input from the issue, when gloo allocates it, to the work's end ([Note: gloo staging]
    in plan/simulate.py; :func:`test_gloo_reduce_scatter_stages_its_input_from_the_issue`
    checks both ends on real gloo), instead of from the wait, where torch first shows it to a
    dispatch mode by splitting it into chunks."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.split.Tensor and not self._known(args[0]):
            return func(*args, **(kwargs or {}))  # gloo's copy: counted from its issue
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _known(self, t: torch.Tensor) -> bool:
        st = t.untyped_storage()
        ref = self._refs.get(id(st))
        return ref is not None and ref() is st

    def __enter__(self) -> _StagedLiveBytes:
        from longboat.comm import collectives

        self._issue = collectives._reduce_scatter
        collectives._reduce_scatter = self._staged(self._issue)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        from longboat.comm import collectives

        collectives._reduce_scatter = self._issue
        super().__exit__(*exc)

    def _staged(self, issue: Any) -> Any:
        """``issue`` (torch's reduce-scatter) with its staging copy counted."""
        import weakref

        tracker = self

        class Work:  # holds torch's work, whose end frees the copy
            def __init__(self, work: Any) -> None:
                self.work = work

            def wait(self, *args: Any) -> Any:
                return self.work.wait(*args)

            def is_completed(self) -> bool:
                return bool(self.work.is_completed())

        def gone(n: int) -> None:
            tracker.live -= n

        def run(output: torch.Tensor, input: torch.Tensor, *, async_op: bool, **kw: Any) -> Any:
            n = input.numel() * input.element_size()
            tracker._add(n)
            work = issue(output, input, async_op=async_op, **kw)
            if not async_op:
                gone(n)
                return work
            held = Work(work)
            weakref.finalize(held, gone, n)
            return held

        return run


def _staged_live_peak(
    strategy: str, micro: int, accumulation: int = 1, held: bool = True
) -> tuple[int, list[str]]:
    """As :func:`_live_peak` at ``micro`` and ``accumulation``, with gloo's staging counted
    from the issue; ``held=False`` lets ZeRO land reductions as soon as they are over. Also
    the units whose buffers outlived their landing (:func:`_landings_after_gloo_lets_go`)."""
    import longboat

    tracker = _StagedLiveBytes()
    hold = _reductions_held_to_their_wait() if held else contextlib.nullcontext()
    with tracker, hold, _landings_after_gloo_lets_go() as still_held:
        torch.manual_seed(0)
        net = GPT(**GPT_ARGS)
        cfg = {**_config(strategy, "gpt", {}), "comm": {"desync_check": False}}
        cfg["batch"] = {"micro_batch_size": micro, "gradient_accumulation_steps": accumulation}
        engine = longboat.initialize(net, OPTIMIZERS["adamw"](net.parameters()), cfg)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2 * accumulation):
            x, y = synthetic_tokens(micro, GPT_ARGS["seq_len"], GPT_ARGS["vocab_size"], gen)
            engine.backward(gpt_loss(engine(x), y))
            engine.step()
        engine.close()
    return tracker.max_peak, still_held


@pytest.mark.parametrize(
    ("strategy", "accumulation", "world"),
    [("zero-1", 1, 4), ("zero-1", 1, 2), ("zero-2", 1, 2), ("zero-2", 4, 2), ("zero-3", 4, 2)],
)
def test_zero_peak_counts_gloo_staging_and_equals_the_real_peak(
    ranks, strategy, accumulation, world
):
    # Micro-batch 1: the peak is in the backward, where the units' reductions are in flight
    # (buckets of 0.01 MiB: several units), each holding gloo's copy of its input; with
    # accumulation, ZeRO-2 and 3 reduce after every micro-batch.
    batch = {"micro_batch_size": 1, "gradient_accumulation_steps": accumulation}
    cfg = load_config({**_config(strategy, "gpt", {}), "batch": batch})
    target = resolve("gpt", GPT_ARGS)
    cfg = strategy_config(cfg, strategy, 1)
    gloo = simulate(target, cfg, world, 1, OPTIMIZERS["adamw"]).peak  # the default backend
    nccl = simulate(target, cfg, world, 1, OPTIMIZERS["adamw"], backend="nccl").peak
    for rank, (real, still_held) in enumerate(
        ranks(world, _staged_live_peak, strategy, 1, accumulation)
    ):
        # The real run's token batch is one [B, T + 1] tensor, sliced: a few hundred bytes.
        assert -1024 <= real - gloo <= 1024, f"rank {rank}: plan {gloo} (nccl {nccl}), real {real}"
        assert not still_held, f"rank {rank}: buffers alive after landing: {still_held}"
    # NCCL reduce-scatters in place: no copy. Nor does gloo for stages 2-3, whose buffers the
    # doorway reduces in place ([Note: gloo reduce-scatter]), nor at two ranks, where it
    # exchanges chunks ([Note: gloo reduce-scatter of two]); stage 1 keeps its buffer.
    assert (gloo > nccl) == (strategy == "zero-1" and world > 2), (gloo, nccl)
    plan = make_plan(target, cfg, world, 1, "adamw", [strategy])
    assert plan.accumulation == accumulation and plan.strategies[0].peak == gloo


def test_a_real_peak_with_early_landings_stays_under_the_plan(ranks):
    """What a run does by default: ZeRO lands each reduction as soon as it is over, freeing its
    full-size buffer during the backward; the plan, which holds each to its wait, bounds it."""
    batch = {"micro_batch_size": 1, "gradient_accumulation_steps": 4}
    cfg = strategy_config(
        load_config({**_config("zero-2", "gpt", {}), "batch": batch}), "zero-2", 1
    )
    plan = simulate(resolve("gpt", GPT_ARGS), cfg, 2, 1, OPTIMIZERS["adamw"]).peak
    for rank, (real, still_held) in enumerate(ranks(2, _staged_live_peak, "zero-2", 1, 4, False)):
        assert real <= plan + 1024, f"rank {rank}: plan {plan}, real {real}"
        # A landing during the backward frees the unit's full-size buffer then, not when the
        # gradient hook that landed it returns.
        assert not still_held, f"rank {rank}: buffers alive after landing: {still_held}"


def _rs_staging(size: int) -> list[int]:
    """On real gloo: bytes malloc holds (mallinfo2) before an asynchronous reduce-scatter of
    ``size`` floats, after its issue, after its wait, after its work goes; and the bytes the
    planner's tracker sees appear at the wait."""
    import ctypes
    import gc

    import torch.distributed as dist

    class Info(ctypes.Structure):
        _fields_ = (
            [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks")]
            + [(f, ctypes.c_size_t) for f in ("hblkhd", "usmblks", "fsmblks", "uordblks")]
            + [(f, ctypes.c_size_t) for f in ("fordblks", "keepcost")]
        )

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = Info

    def used() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    x, out = torch.ones(size), torch.empty(size // 2)
    issue = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    dist.barrier()
    before = used()
    work = issue(out, x, async_op=True)
    issued = used()
    work.wait()
    waited = used()
    del work
    gc.collect()
    after = used()
    tracker = LiveBytes()  # a second one, under the planner's tracker
    with tracker:
        work = issue(out, x, async_op=True)
        unseen = tracker.live
        work.wait()
        seen = tracker.live - unseen
    del work
    return [before, issued, waited, after, seen]


def test_gloo_reduce_scatter_stages_its_input_from_the_issue(ranks):
    # [Note: gloo staging]: what the planner's meta doorway assumes of gloo, on real gloo.
    size = 4 * 2**20  # 16 MiB: mmap'ed by malloc, so counted exactly by hblkhd
    # Fresh workers: a disk home an earlier test built gave its process's torch a pool of large
    # blocks ([Note: warm blocks] in cpu_pool.py), which malloc's counters do not see.
    ranks.pool(2).restart()
    for before, issued, waited, after, seen in ranks(2, _rs_staging, size):
        copy = 4 * size  # the input's bytes; the output is half of them
        # Allocated at the issue, of the whole input (gloo's own bookkeeping adds a little).
        assert copy <= issued - before < copy * 1.25
        assert waited - before >= copy  # still held after the wait
        assert after - before < 2**20  # freed with the work
        assert copy <= seen < copy + 2**20  # the tracker first sees it at the wait


def test_bf16_shrinks_activations_and_fp16_plans_alike():
    # At micro-batch 8 the 2-byte matmul outputs outweigh the bf16 weight copies autocast
    # keeps during the forward (2 bytes per parameter); at micro-batch 2 they do not.
    target = resolve("reference-gpt")
    acts = {}
    for dtype in ("fp32", "bf16", "fp16"):
        base = load_config({"precision": {"dtype": dtype}})
        acts[dtype] = make_plan(target, base, 2, 8, "adamw", ["zero-2"]).strategies[0]
    assert acts["bf16"].activations < 0.9 * acts["fp32"].activations
    assert acts["fp16"].activations == acts["bf16"].activations
    assert acts["bf16"].model_state == acts["fp32"].model_state  # fp32 master weights


def test_communication_bytes_follow_the_ring_formulas():
    target = resolve("gpt", GPT_ARGS)
    a = gpt_param_count(**{k: v for k, v in GPT_ARGS.items() if k != "n_heads"})
    n = 4
    base = load_config(_config("replicate", "gpt", {}))
    plan = make_plan(target, base, n, MICRO, "adamw", ["replicate", "zero-1"])
    rep, z1 = plan.strategies
    tensors = len(list(target.build().parameters()))
    # Ring all-reduce: 2(n-1)/n of the 4a gradient bytes over all buckets, and of one 4-byte
    # usage flag per parameter ([Note: usage flags]).
    assert rep.comm_bytes == {"all_reduce": 2 * (n - 1) * 4 * (a + tensors) // n}
    padded = z1.model_state["parameters"] // 4  # stage 1 keeps the padded flat parameters
    assert padded > a  # odd sizes: padding travels too
    # ZeRO's usage flags go over the control plane, which the plan does not count (a few bytes
    # whose values fake tensors do not have).
    assert z1.comm_bytes == {
        "reduce_scatter": (n - 1) * 4 * padded // n,
        "all_gather": (n - 1) * 4 * padded // n,
    }


def test_live_bytes_counts_views_once_and_sees_frees():
    mode = LiveBytes()
    with mode, torch.device("meta"):
        x = torch.empty(1000)  # 4000 bytes
        v = x[10:20].view(2, 5)
        assert mode.live == 4000
        y = x * 2
        assert mode.live == 8000
        del y
        assert mode.live == 4000
        del x, v
        assert mode.live == 0
    assert mode.max_peak == 8000


def test_meta_collectives_allocate_nothing_and_count():
    comm = MetaCollectives(world_size=4)
    t = torch.empty(100, device="meta")
    comm.all_reduce(t)
    comm.reduce_scatter(torch.empty(25, device="meta"), t)
    comm.all_gather(t, torch.empty(25, device="meta"))
    assert comm.sent == {"all_reduce": 600, "reduce_scatter": 300, "all_gather": 300}


# -- the command -----------------------------------------------------------------------------


def _invoke(*args: str):
    return CliRunner().invoke(app, ["plan", *args])


def _gpt_cli(*more: str) -> list[str]:
    """``longboat plan`` arguments for the odd-sized GPT at micro-batch 2, then ``more``."""
    return ["--model", "gpt", "--model-args", json.dumps(GPT_ARGS), "--micro-batch", "2", *more]


def test_json_output_parses_and_matches_the_table(tmp_path):
    args = _gpt_cli("--world-size", "2", "--strategies", "replicate,zero3")  # bench's spelling
    res = _invoke(*args, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [s["strategy"] for s in data["strategies"]] == ["replicate", "zero-3"]
    assert data["recommended"] == "replicate"
    text = _invoke(*args)
    assert text.exit_code == 0, text.output
    assert "recommended: replicate" in text.output


def test_a_small_budget_names_what_does_not_fit_and_exits_1():
    args = _gpt_cli("--strategies", "replicate,zero-1,zero-2,zero-3")
    plans = json.loads(_invoke(*args, "--json").output)["strategies"]
    peaks = sorted((s["peak"], s["strategy"]) for s in plans)
    (low, _), (high, largest) = peaks[0], peaks[-1]
    assert low < high
    res = _invoke(*args, "--budget", str(low))  # exactly the smallest peak fits
    assert res.exit_code == 0, res.output
    assert "do not fit: " in res.output and largest in res.output.split("do not fit: ")[1]
    fitting = [name for peak, name in peaks if peak <= low]
    best = next(n for n in ("replicate", "zero-1", "zero-2", "zero-3") if n in fitting)
    assert f"recommended: {best} (" in res.output
    res = _invoke(*args, "--budget", str(low - 1))
    assert res.exit_code == 1, res.output
    assert "do not fit: replicate, zero-1, zero-2, zero-3" in res.output
    assert "recommended: none" in res.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "nope"], "neither a built-in"),
        (["--model", "no_such_module_xyz:f"], "cannot import"),
        (["--model", "gpt", "--model-args", "{bad"], "not JSON"),
        (["--model", "gpt", "--model-args", '{"depth": 3}'], "depth"),
        (["--budget", "lots"], "not a size"),
        (["--precision", "fp8"], "--precision"),
        (["--strategies", "zero-4"], "zero-4"),
        (["--optimizer", "lion"], "lion"),
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "1", "--strategies", "parameter_server"], "leaves no worker"),
        (["--config", "/no/such/file.toml"], "does not exist"),
        (["--seq-len", "999"], "exceeds"),
    ],
)
def test_usage_errors_exit_2(args, words):
    res = _invoke(*args)
    assert res.exit_code == 2, res.output
    assert words in res.output


def test_a_user_model_describes_its_input(tmp_path, monkeypatch):
    (tmp_path / "my_model_mod.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        def build(width=16):
            return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))

        def example_input(model, micro_batch):
            return torch.randn(micro_batch, 8)
    """)
    )
    (tmp_path / "no_input_mod.py").write_text("from torch import nn\nbuild = nn.Linear\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = _invoke(
        "--model",
        "my_model_mod:build",
        "--model-args",
        '{"width": 32}',
        "--strategies",
        "replicate",
        "--json",
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["trainable_params"] == 8 * 32 + 32 + 32 * 3 + 3
    assert data["strategies"][0]["model_state"]["parameters"] == 4 * data["trainable_params"]
    res = _invoke("--model", "no_input_mod:build")
    assert res.exit_code == 2
    assert "example_input" in res.output


def test_planning_a_billion_parameters_allocates_nothing(tmp_path):
    args = {"vocab_size": 50304, "d_model": 2048, "n_layers": 20, "n_heads": 16, "seq_len": 256}
    code = textwrap.dedent(f"""
        import json, resource
        from longboat.config import load_config
        from longboat.plan import make_plan, resolve
        plan = make_plan(resolve("gpt", {args!r}), load_config({{}}), 8, 1, "adamw",
                         ["replicate", "zero-3"])
        print(json.dumps({{"params": plan.trainable_params,
                          "peaks": [s.peak for s in plan.strategies],
                          "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    a = gpt_param_count(**{k: v for k, v in args.items() if k != "n_heads"})
    assert data["params"] == a > 1_000_000_000
    assert data["peaks"][0] > 16 * a  # replicate holds 16 bytes per parameter and more
    # The parameters alone would be 4 GiB; the planner stays within its own imports' size.
    assert data["maxrss_kib"] * 1024 < 1 * 2**30, data


def test_strategy_config_keeps_the_users_settings():
    base = load_config(
        {"zero": {"bucket_mb": 3.0, "unit_classes": ["_Block"]}, "precision": {"dtype": "bf16"}}
    )
    cfg = strategy_config(base, "zero-3", 4)
    assert (cfg.strategy, cfg.zero.stage, cfg.zero.bucket_mb) == ("zero", 3, 3.0)
    assert cfg.zero.unit_classes == ["_Block"] and cfg.precision.dtype == "bf16"
    assert cfg.batch.micro_batch_size == 4


def test_a_config_file_reaches_the_strategies(tmp_path):
    cfg = tmp_path / "run.toml"
    # A set size chooses units by size (small modules), not the blocks GPT declares
    cfg.write_text("[zero]\nunit_min_params = 100\n")
    args = [
        "--model",
        "gpt",
        "--model-args",
        json.dumps(GPT_ARGS),
        "--micro-batch",
        "2",
        "--strategies",
        "zero-3",
        "--json",
    ]
    res = _invoke(*args, "--config", str(cfg))
    assert res.exit_code == 0, res.output
    expected = make_plan(resolve("gpt", GPT_ARGS), load_config(cfg), 2, 2, "adamw", ["zero-3"])
    assert json.loads(res.output)["strategies"][0]["peak"] == expected.strategies[0].peak
    default = json.loads(_invoke(*args).output)["strategies"][0]["peak"]
    assert default != expected.strategies[0].peak  # units by size, not by block: another plan
    cfg.write_text("[zero]\nunit_min_param = 100\n")
    res = _invoke(*args, "--config", str(cfg))
    assert res.exit_code == 2
    assert "unit_min_params" in res.output  # the closest valid key


def test_both_doorways_implement_the_protocol():
    """The planner hands the engine a MetaCollectives where a rank has a Collectives; both
    implement the one Comm protocol the engine and the strategies are written against."""
    for doorway in (Collectives(), Collectives.alone(), MetaCollectives(2)):
        assert isinstance(doorway, Comm), type(doorway).__name__


# -- with pipeline stages ----------------------------------------------------------------------

PIPE_MICRO_BATCHES = 4


def _pipe_config(strategy: str, pp: int, schedule: str) -> dict[str, Any]:
    cfg = _config(strategy, "gpt", {})
    cfg["mesh"] = {"pp": pp}
    cfg["pipeline"] = {"schedule": schedule}
    cfg["batch"] = {"micro_batch_size": MICRO, "gradient_accumulation_steps": PIPE_MICRO_BATCHES}
    return cfg


def _pipe_real(strategy: str, pp: int, schedule: str) -> tuple[dict[str, int], int]:
    """Two real train_steps of a pipeline rank: memory_report's bytes and the live peak (with
    gloo's reduce-scatter staging counted from the issue and reductions landed at their wait,
    as the plan counts them)."""
    import longboat

    tracker = _StagedLiveBytes()
    with tracker, _reductions_held_to_their_wait(), _landings_after_gloo_lets_go():
        torch.manual_seed(0)
        net = GPT(**GPT_ARGS)
        engine = longboat.initialize(
            net, OPTIMIZERS["adamw"](net.parameters()), _pipe_config(strategy, pp, schedule)
        )
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = synthetic_tokens(
                MICRO * PIPE_MICRO_BATCHES, GPT_ARGS["seq_len"], GPT_ARGS["vocab_size"], gen
            )
            engine.train_step((x, y), lambda out, mb: gpt_loss(out, mb[1]))
        measured = engine.memory_report().measured
        engine.close()
    return measured, tracker.max_peak


@pytest.mark.parametrize(
    ("strategy", "world", "schedule"),
    [("replicate", 2, "1f1b"), ("replicate", 2, "gpipe"), ("zero-2", 4, "1f1b")],
)
def test_each_stage_equals_a_real_pipeline_rank(ranks, strategy, world, schedule):
    """Per pipeline rank: the model state byte for byte, and the peak of live tensors through
    the schedule, to within the real run's token batch (drawn as one [B, T + 1] tensor with
    its targets, which the plan's zeros do not have) and 1 KiB of small CPU tensors. With
    data-parallel peers, real collectives add what the plan leaves out: the desync check's
    fingerprints (4 KiB here) and reductions that finish at other moments than the plan's
    (which keeps each buffer until it is waited; the real run does too here): measured 2.3% of
    stage 0's peak, allowed 3%."""
    pp = 2
    plan = make_plan(
        resolve("gpt", GPT_ARGS),
        load_config(_pipe_config(strategy, pp, schedule)),
        world,
        MICRO,
        "adamw",
        [strategy],
    )
    rows = plan.strategies
    assert [r.stages for r in rows] == [(0,), (1,)]
    real = ranks(world, _pipe_real, strategy, pp, schedule)
    slack = 8 * MICRO * PIPE_MICRO_BATCHES * (GPT_ARGS["seq_len"] + 1) + 1024
    for stage, row in enumerate(rows):
        measured, peak = real[stage * (world // pp)]  # the first data-parallel rank of it
        assert row.model_state == measured, f"stage {stage}: {row.model_state} != {measured}"
        allowed = slack + (0.03 * peak if world > pp else 0)
        assert abs(row.peak - peak) <= allowed, f"stage {stage}: plan {row.peak}, real {peak}"


def _with_header(nbytes: int) -> int:
    """An activation's message once its stream has settled ([Note: shapes on the wire])."""
    return -(-nbytes // 8) * 8 + HEADER_BYTES


def test_stage_activations_and_sends_follow_the_schedule():
    target = resolve("gpt", GPT_ARGS)

    def rows(schedule: str) -> list[Any]:
        base = load_config(_pipe_config("replicate", 2, schedule))
        return make_plan(target, base, 2, MICRO, "adamw", ["replicate"]).strategies

    gpipe, one_f = rows("gpipe"), rows("1f1b")
    m = PIPE_MICRO_BATCHES
    # GPipe keeps every micro-batch's activations on every stage; 1F1B at most p - r.
    assert [r.in_flight for r in gpipe] == [m, m]
    assert [r.in_flight for r in one_f] == [2, 1]
    for g, f in zip(gpipe, one_f, strict=True):
        assert g.activations == m * f.activations // f.in_flight
    assert gpipe[0].peak > one_f[0].peak and gpipe[1].peak > one_f[1].peak
    # ZB-H1 defers the last stage's weight passes: it holds p micro-batches there, as the first
    # stage does under both.
    zb = rows("zb-h1")
    assert [r.in_flight for r in zb] == [2, 2]
    assert zb[0].peak == one_f[0].peak and zb[1].activations == 2 * one_f[1].activations
    # Stage 0 sends each micro-batch's activation, stage 1 its gradient: [B, T, d] fp32 each,
    # an activation with its header once the stream has settled (every step after the first).
    # One data-parallel rank: nothing else.
    boundary = 4 * MICRO * GPT_ARGS["seq_len"] * GPT_ARGS["d_model"]
    assert [r.comm_bytes for r in one_f] == [
        {"send": m * _with_header(boundary)},
        {"send": m * boundary},
    ]


def test_interleaved_stages_are_planned_in_rounds():
    """Rank 0's stage 2 needs rank 1's stage 1: each rank's simulation runs again once the
    other has recorded what it sends ([Note: planning stages])."""
    cfg = _pipe_config("replicate", 2, "interleaved")
    cfg["pipeline"]["virtual_stages"] = 2
    args = {**GPT_ARGS, "n_layers": 2}
    plan = make_plan(resolve("gpt", args), load_config(cfg), 2, MICRO, "adamw", ["replicate"])
    assert [r.stages for r in plan.strategies] == [(0, 2), (1, 3)]
    assert plan.pipeline is not None and plan.pipeline["virtual_stages"] == 2
    boundary = 4 * MICRO * GPT_ARGS["seq_len"] * GPT_ARGS["d_model"]
    # Per micro-batch, rank 0 (stages 0, 2) sends the activations 0->1 and 2->3 and the
    # gradient 2->1; rank 1 (stages 1, 3) the activation 1->2 and the gradients 1->0, 3->2.
    m = PIPE_MICRO_BATCHES
    assert [r.comm_bytes["send"] for r in plan.strategies] == [
        m * (2 * _with_header(boundary) + boundary),
        m * (_with_header(boundary) + 2 * boundary),
    ]


@pytest.mark.parametrize(
    ("schedule", "virtual"),
    [("gpipe", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved-zb", 2)],
)
def test_receives_posted_ahead_move_a_buffer_not_the_activations(monkeypatch, schedule, virtual):
    """A receive posted ahead ([Note: receives posted ahead]) allocates the next action's buffer
    during the action before it: each stage's activations per micro-batch are what they are
    when every receive is posted only when due, and the peak holds at most one more buffer
    (the real run's peak is compared in test_each_stage_equals_a_real_pipeline_rank)."""
    from longboat.pipeline import runtime

    cfg = _pipe_config("replicate", 2, schedule)
    cfg["pipeline"]["virtual_stages"] = virtual
    target = resolve("gpt", GPT_ARGS)

    def rows() -> list[Any]:
        return make_plan(target, load_config(cfg), 2, MICRO, "adamw", ["replicate"]).strategies

    ahead = rows()
    monkeypatch.setattr(runtime._Ahead, "post", lambda self: None)
    when_due = rows()
    boundary = 4 * MICRO * GPT_ARGS["seq_len"] * GPT_ARGS["d_model"]
    assert [r.activations for r in ahead] == [r.activations for r in when_due]
    more = [a.peak - d.peak for a, d in zip(ahead, when_due, strict=True)]
    assert all(0 <= b <= _with_header(boundary) for b in more), more
    assert any(more), "no receive was posted ahead"


def test_plan_cli_with_stages(tmp_path):
    base = _gpt_cli("--world-size", "2", "--strategies", "single,replicate")
    args = [*base, "--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"]
    res = _invoke(*args, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [(s["strategy"], s["stages"]) for s in data["strategies"]] == [
        ("single", []),
        ("replicate", [0]),
        ("replicate", [1]),
    ]
    assert data["pipeline"] == {
        "pp": 2,
        "dp": 1,
        "schedule": "gpipe",
        "virtual_stages": 1,
        "micro_batches": 4,
        "idle_fraction": pytest.approx(1 / 5),
    }
    assert data["trainable_params"] == gpt_param_count(
        **{k: v for k, v in GPT_ARGS.items() if k != "n_heads"}
    )
    text = _invoke(*args)
    assert text.exit_code == 0, text.output
    assert "gpipe, 4 micro-batches of 2 per step: idle fraction 20%" in text.output
    for flags, words in (
        (["--pp", "0"], "--pp 0"),
        (["--pp", "3"], "3"),
        (["--schedule", "zigzag"], "pipeline.schedule"),
        (["--micro-batches", "1"], "micro-batches"),
    ):
        bad = [*base, "--pp", "2", "--schedule", "1f1b", "--micro-batches", "4", *flags]
        res = _invoke(*bad)
        assert res.exit_code == 2, (flags, res.output)
        assert words in res.output, (flags, res.output)


def test_accumulation_is_simulated_and_collectives_are_counted():
    # Each simulated optimizer step runs the config's accumulation of micro-batches: ZeRO-2
    # reduce-scatters after every one of them (4 x the bytes and calls of one), ZeRO-1 at the
    # boundary only; and the peak is that of the micro-batch, not of the whole step.
    from longboat.plan import simulate

    target = resolve("gpt", GPT_ARGS)
    sims = {}
    for stage in (1, 2):
        for acc in (1, 4):
            cfg = load_config(
                {
                    "strategy": "zero",
                    "zero": {"stage": stage},
                    "batch": {"micro_batch_size": MICRO, "gradient_accumulation_steps": acc},
                }
            )
            sims[stage, acc] = simulate(target, cfg, 2, MICRO, OPTIMIZERS["adamw"])
    for acc in (1, 4):
        assert sims[1, acc].comm_bytes == sims[1, 1].comm_bytes  # at the boundary only
        assert sum(sims[1, acc].comm_calls.values()) >= 2
    one, four = sims[2, 1], sims[2, 4]
    assert four.comm_bytes["reduce_scatter"] == 4 * one.comm_bytes["reduce_scatter"]
    assert four.comm_calls["reduce_scatter"] == 4 * one.comm_calls["reduce_scatter"]
    assert four.comm_calls["all_gather"] == one.comm_calls["all_gather"]
    assert four.model_state == one.model_state


def test_plan_cli_plans_the_accumulation(tmp_path):
    # `--micro-batches` (or the config's batch triple) is the accumulation the simulation runs:
    # ZeRO-2 reduce-scatters after every micro-batch, so its bytes per step follow it.
    def plan(*more: str) -> dict[str, Any]:
        res = _invoke(*_gpt_cli("--world-size", "2", "--strategies", "zero-2", "--json", *more))
        assert res.exit_code == 0, res.output
        return json.loads(res.output)

    one, four = plan(), plan("--micro-batches", "4")
    assert (one["accumulation"], four["accumulation"]) == (1, 4)
    sent = [p["strategies"][0]["comm_bytes"]["reduce_scatter"] for p in (one, four)]
    assert sent[1] == 4 * sent[0]
    target = resolve("gpt", GPT_ARGS)
    cfg = load_config({"strategy": "zero", "zero": {"stage": 2}, "log": {"progress": False}})
    cfg = cfg.model_copy(
        update={"batch": cfg.batch.model_copy(update={"gradient_accumulation_steps": 4})}
    )
    sim = simulate(target, strategy_config(cfg, "zero-2", 2), 2, 2, OPTIMIZERS["adamw"])
    assert four["strategies"][0]["peak"] == sim.peak
    assert four["strategies"][0]["comm_bytes"] == sim.comm_bytes
    text = _invoke(*_gpt_cli("--world-size", "2", "--strategies", "zero-2", "--micro-batches", "4"))
    assert "micro-batch 2 x 4 per step (accumulation)" in " ".join(text.output.split())

    # The config's batch triple: 16 samples a step in micro-batches of 2 on 2 ranks is 4.
    toml = tmp_path / "run.toml"
    toml.write_text("[batch]\ntrain_batch_size = 16\nmicro_batch_size = 2\n")
    res = _invoke(
        "--model", "gpt", "--model-args", json.dumps(GPT_ARGS), "--world-size", "2",
        "--strategies", "zero-2", "--json", "--config", str(toml),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    from_config = json.loads(res.output)
    assert (from_config["micro_batch"], from_config["accumulation"]) == (2, 4)
    assert from_config["strategies"] == four["strategies"]
    # --micro-batch overrides the config's: the accumulation is derived from the global batch.
    assert plan("--config", str(toml), "--micro-batch", "4")["accumulation"] == 2
    # A triple that does not divide: the config's own message, exit 2.
    res = _invoke(*_gpt_cli("--world-size", "2", "--config", str(toml), "--micro-batch", "3"))
    assert res.exit_code == 2, res.output
    assert "train_batch_size=16 is not divisible by micro_batch_size=3" in res.output


@pytest.mark.parametrize(
    "strategy", ["single", "replicate", "zero-1", "zero-2", "zero-3", "zero-3+offload"]
)
def test_folded_accumulation_predicts_what_every_micro_batch_does(strategy):
    # [Note: folded accumulation]: 8 micro-batches a step simulated as 4, the third counted
    # for the 5 between the second and the last; every figure as when all 8 run.
    from dataclasses import asdict

    def config(accumulation: int) -> Any:
        base = load_config({**_config("zero-1", "gpt", {}), "batch": {"micro_batch_size": 2}})
        batch = base.batch.model_copy(update={"gradient_accumulation_steps": accumulation})
        return strategy_config(base.model_copy(update={"batch": batch}), strategy, 2)

    n = 1 if strategy == "single" else 2
    target = resolve("gpt", GPT_ARGS)
    folded = simulate(target, config(8), n, 2, OPTIMIZERS["adamw"])
    every = simulate(target, config(8), n, 2, OPTIMIZERS["adamw"], fold=False)
    assert asdict(folded) == asdict(every)
    if strategy in ("zero-2", "zero-3"):  # a reduction per micro-batch: 8 of one's
        one = simulate(target, config(1), n, 2, OPTIMIZERS["adamw"])
        assert folded.comm_calls["reduce_scatter"] == 8 * one.comm_calls["reduce_scatter"]
        assert folded.comm_bytes["reduce_scatter"] == 8 * one.comm_bytes["reduce_scatter"]
    if strategy == "zero-3+offload":
        assert folded.disk_moved > every.disk_moved / 8 > 0


# -- real models: a reason per row, never a traceback ----------------------------------------

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SMALL_GPT2 = {"width": 32, "heads": 4}
SMALL_LLAMA = {"width": 32, "heads": 4}


def _untraced(res: Any, code: int) -> str:
    """The command's output, having ended with ``code`` and no traceback."""
    assert res.exit_code == code, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output, res.output
    return res.output


@pytest.fixture
def hfmodels(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(FIXTURES))


def _hf_cli(model: str, args: dict[str, int], *more: str) -> list[str]:
    """``longboat plan`` arguments for a model of ``tests/fixtures/hfmodels.py`` at
    micro-batch 2, then ``more``."""
    return ["--model", f"hfmodels:{model}", "--model-args", json.dumps(args), "--micro-batch",
            "2", *more]  # fmt: skip


def test_transformers_stages_and_tensor_parallelism_are_planned(hfmodels):
    # built-in pipeline layers and tensor-parallel plan; the planner's loss takes the logits,
    # of the output object at one stage and of the last stage's tensor in a pipeline
    args = ["--world-size", "4", "--pp", "2", "--tp", "2", "--strategies", "single,zero-1"]
    res = _invoke(*_hf_cli("gpt2", SMALL_GPT2, *args, "--json"))
    data = json.loads(_untraced(res, 0))
    assert [(s["strategy"], s["stages"], s["error"]) for s in data["strategies"]] == [
        ("single", [], ""),
        ("zero-1", [0], ""),
        ("zero-1", [1], ""),
    ]
    assert data["pipeline"]["micro_batches"] == 2, "with --pp, as many as the stages"
    assert data["strategies"][1]["tp_layers"]["transformer.h.0.attn.c_attn"] > 0
    # between the stages only the hidden state: 2 micro-batches of [2, SEQ, width] in fp32,
    # forward with its header, backward without
    hidden = 2 * 32 * SMALL_GPT2["width"] * 4
    sends = [row["comm_bytes"]["send"] for row in data["strategies"][1:]]
    assert sends == [2 * _with_header(hidden), 2 * hidden]


def test_a_model_that_cannot_be_split_says_why_in_its_rows(hfmodels):
    bert = ("bert", {"width": 32, "layers": 1}, "--pp", "2", "--strategies")
    out = _untraced(_invoke(*_hf_cli(*bert, "single,replicate,zero-2")), 1)
    # exit 1: nothing to recommend, a verdict and not a usage error
    assert "not planned: replicate, zero-2: mesh.pp = 2: pipeline stages need" in out
    assert "BertForMaskedLM is none of them" in out
    assert out.count("not planned: ") == 1, "one line per reason"
    assert "recommended: none (replicate, zero-2 could not be planned" in out
    single = next(line for line in out.splitlines() if line.startswith("│ single"))
    assert "n/a" not in single and "-" in single  # planned; no budget, so fits is "-"
    rows = json.loads(_untraced(_invoke(*_hf_cli(*bert, "single,replicate", "--json")), 1))
    errors = [s["error"] for s in rows["strategies"]]
    assert errors[0] == "" and "pipeline stages need" in errors[1]


def test_a_tensor_parallel_plan_that_does_not_apply_says_why_under_a_budget(hfmodels):
    t5 = _hf_cli("t5", {"width": 32, "layers": 1}, "--tp", "2", "--budget", "1GiB")
    out = _untraced(_invoke(*t5), 1)
    assert "no built-in plan for a T5ForConditionalGeneration" in out
    assert "not planned: replicate, zero-1, zero-2, zero-3: tensor_parallel.plan" in out
    assert "could not be planned" in out.split("recommended: ")[1]


def test_user_names_are_printed_as_given(hfmodels):
    # ":llama" followed by ":" in the title would be an emoji code to rich
    out = _untraced(_invoke(*_hf_cli("llama", SMALL_LLAMA, "--strategies", "replicate")), 0)
    assert out.startswith("hfmodels:llama: ") and "\N{LLAMA}" not in out
    # reasons keep their brackets: rich would take "[mesh]" for a style
    plan = Plan(
        "pkg:[bold]x[/bold]:smile:", 1, 2, 1, "fp32", "adamw", None,
        [StrategyPlan("replicate", 2, dict.fromkeys(CATEGORIES, 0), 0, 0, 0, {}, None,
                      error="[mesh] pp = 2 :smile:")],
        None, "",
    )  # fmt: skip
    text = render(plan)
    assert text.startswith("pkg:[bold]x[/bold]:smile::")
    assert "not planned: replicate: [mesh] pp = 2 :smile:" in text


def test_a_model_fake_tensors_cannot_run_says_why_in_each_row(tmp_path, monkeypatch):
    (tmp_path / "branchy_mod.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                h = self.fc(x)
                return h[h > 0].sum() + h.mean()  # a shape that depends on values

        def example_input(model, micro_batch):
            return torch.randn(micro_batch, 4)
        """)
    )
    (tmp_path / "broken_mod.py").write_text(
        textwrap.dedent("""
        def build():
            raise ValueError("width 0 is too small")

        def example_input(model, micro_batch):
            return None
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    res = _invoke("--model", "branchy_mod:Branchy", "--strategies", "replicate,zero-3")
    out = _untraced(res, 1)
    assert "not planned: replicate, zero-3: DynamicOutputShapeException" in out
    assert "fake tensors: shapes without values" in out
    # a model that cannot be built at all is the command line's mistake, in one line
    res = _invoke("--model", "broken_mod:build")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.strip().splitlines() == [
        "longboat: error: --model 'broken_mod:build': building the model failed: "
        "ValueError: width 0 is too small"
    ]
