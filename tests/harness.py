"""The longboat side of the equivalence tests: a recipe (``reference.Recipe``) trained through
``longboat.initialize`` on each rank of a pool, recording what the plain reference needs to
replay the run (which samples each rank saw in each micro-batch) and what it is compared on
(every micro-batch's loss, the final parameters and buffers, the optimizer state)."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import runpy
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import reference
import torch
from torch.utils.data import TensorDataset

import longboat
import longboat.ps

QUIET = {"log": {"progress": False, "level": "WARNING"}}

DATASETS = {
    "tiny": reference.dataset,
    "tied": reference.dataset,
    "chain": reference.dataset,
    "reused": reference.dataset,
    "zoo": reference.zoo_dataset,
    "gpt2": reference.token_dataset,
    "llama": reference.token_dataset,
    "mixtral": reference.token_dataset,
    "lstm": reference.token_dataset,
    "bert": reference.masked_dataset,
    "albert": reference.masked_dataset,
    "t5": reference.seq2seq_dataset,
    "resnet": reference.image_dataset,
}


def data_for(recipe: reference.Recipe, n: int) -> TensorDataset:
    """The recipe's data set with sample ids in front."""
    data = DATASETS[recipe.model](n)
    return data if recipe.model == "zoo" else reference.indexed(data)


def config(
    strategy: dict[str, Any], recipe: reference.Recipe, global_batch: int, micro: int, **extra: Any
) -> dict[str, Any]:
    """A longboat config for ``recipe`` under ``strategy`` (e.g. {"strategy": "replicate"})."""
    precision: dict[str, Any] = {}
    if recipe.precision == "bf16":
        precision = {"dtype": "bf16"}
    elif recipe.precision == "fp16":
        # One overflow halves the scale (hysteresis 1), as torch's GradScaler does.
        power = int(recipe.loss_scale).bit_length() - 1
        precision = {
            "dtype": "fp16",
            "initial_scale_power": power,
            "hysteresis": 1,
            "loss_scale_window": recipe.loss_scale_window,
        }
    return {
        **QUIET,
        **strategy,
        "gradient_clipping": recipe.clip,
        "precision": precision,
        "batch": {"train_batch_size": global_batch, "micro_batch_size": micro},
        **extra,
    }


def train(
    recipe: reference.Recipe,
    cfg: dict[str, Any],
    steps: int,
    perturb: bool = True,
    poison: tuple[int, int] | None = None,
    poison_how: str = "loss",
) -> dict[str, Any]:
    """Train ``recipe`` under ``cfg`` for ``steps`` optimizer steps on this rank.

    ``poison = (step, rank)`` makes that rank meet an overflow in that (1-based) step: with
    ``poison_how='loss'`` its loss is multiplied by inf; with ``'grad'`` an inf is put into one
    of the gradients it owns after communication, where only this rank can see it."""
    model, opt, sched = recipe.build()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if perturb and rank:
        with torch.no_grad():  # the strategy must start every rank from rank 0's weights
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    try:
        engine = longboat.initialize(model, opt, cfg, scheduler=sched)
    except longboat.ps.ServerExit as served:  # a parameter server's rank: what it served
        return {"served": served.summary}
    if poison is not None and poison_how == "grad" and poison[1] == rank:
        own = engine.strategy.local_gradients

        def local_gradients() -> list[torch.Tensor]:
            grads = own()
            if engine.global_step + 1 == poison[0]:
                grads[0].view(-1)[0] = float("inf")
            return grads

        engine.strategy.local_gradients = local_gradients  # type: ignore[method-assign]
    data = data_for(recipe, engine.batch.train_batch_size * steps)
    ids: list[list[list[int]]] = []
    losses: list[list[float]] = []
    lrs: list[float] = []
    step_ids: list[list[int]] = []
    step_losses: list[float] = []
    skipped: list[int] = []
    scales: list[float] = []
    for batch in engine.loader(data):
        sample_ids, *rest = batch
        loss = reference.forward_loss(engine, rest)
        if poison_how == "loss" and poison == (engine.global_step + 1, rank):
            loss = loss * float("inf")
        engine.backward(loss)
        step_ids.append(sample_ids.tolist())
        step_losses.append(float(loss.detach()))
        before = engine.skipped_steps
        if engine.step():
            if engine.skipped_steps > before:
                skipped.append(engine.global_step)
            scales.append(engine.precision.loss_scale)
            ids.append(step_ids)
            losses.append(step_losses)
            lrs.append(opt.param_groups[0]["lr"])
            step_ids, step_losses = [], []
            if engine.global_step == steps:
                break
    assert engine.global_step == steps, f"the loader ran out after {engine.global_step} steps"
    scaler = engine.precision.scaler
    out = {
        "ids": ids,
        "losses": losses,
        "lrs": lrs,
        "skipped": skipped,
        "scales": scales if scaler is not None else [],
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": optimizer_pieces(engine),
        "overlapped": getattr(engine.strategy, "overlapped_steps", None),
        # ZeRO: what each unit (stage 3: module) or bucket is, to check which a case made
        "units": [u.tag for u in getattr(engine.strategy, "units", ())],
    }
    engine.close()
    return out


def optimizer_pieces(engine: longboat.Engine) -> dict[str, Any]:
    """This rank's optimizer state as (name, key, full shape, start, end, tensor, slices) pieces
    of the full per-parameter tensors (``slices``: tensor parallelism's n-dimensional slices the
    range counts in, or None), and the scalars per parameter name."""
    state = engine.strategy.checkpoint_state(engine.model, engine.optimizer)
    pieces = [
        (
            p.name,
            p.key.removeprefix("optim."),
            p.shape,
            p.start,
            p.end,
            p.tensor.detach().clone(),
            p.slices,
        )
        for p in state.pieces
        if p.key != "model"
    ]
    scalars = {
        name: {k: (v["value"] if isinstance(v, dict) else v) for k, v in sc.items()}
        for name, sc in state.scalars.items()
    }
    return {"pieces": pieces, "scalars": scalars}


def assemble(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's optimizer pieces put together: name -> {key: full tensor or scalar}.
    Pieces that two ranks hold (replicated state) must agree."""
    full: dict[str, dict[str, Any]] = {}
    filled: dict[tuple[str, str], torch.Tensor] = {}
    for res in results:
        for name, key, shape, start, end, t, slices in res["optim"]["pieces"]:
            buf = full.setdefault(name, {}).setdefault(
                key, torch.full(tuple(shape), float("nan"), dtype=t.dtype)
            )
            mask = filled.setdefault((name, key), torch.zeros(tuple(shape), dtype=torch.bool))
            local_buf = buf.view(-1) if slices is None else slices.take(buf).view(-1)
            local_mask = mask.view(-1) if slices is None else slices.take(mask).view(-1)
            seen = local_mask[start:end]
            assert torch.equal(local_buf[start:end][seen], t[seen]), (
                f"ranks disagree on {name} {key}"
            )
            local_buf[start:end] = t
            local_mask[start:end] = True
            if slices is not None:
                slices.put(buf, local_buf.view(slices.shape))
                slices.put(mask, local_mask.view(slices.shape))
        for name, sc in res["optim"]["scalars"].items():
            for k, v in sc.items():
                prev = full.setdefault(name, {}).setdefault(k, v)
                assert prev == v, f"ranks disagree on {name} {k}: {prev} vs {v}"
    for (name, key), mask in filled.items():
        assert bool(mask.all()), f"no rank holds all of {name} {key}"
    return full


def order_of(results: list[dict[str, Any]]) -> list[list[list[list[int]]]]:
    """[step][micro][rank] -> sample ids, from every rank's record."""
    steps, micros = len(results[0]["ids"]), len(results[0]["ids"][0])
    return [[[res["ids"][s][t] for res in results] for t in range(micros)] for s in range(steps)]


def compare(
    results: list[dict[str, Any]],
    plain: reference.PlainRun,
    tol: float,
    own_buffers: frozenset[str] = frozenset(),
) -> None:
    """Assert that a distributed run equals the plain one: every micro-batch's loss on every
    rank, then parameters and buffers on every rank, then the optimizer state (tensors within
    ``tol`` relative, scalars such as Adam's ``step`` exactly, the same parameters holding
    state), and the learning rate after every step."""
    for r, res in enumerate(results):
        assert res["skipped"] == plain.skipped, (
            f"rank {r} skipped steps {res['skipped']}, plain {plain.skipped}"
        )
        for s, step in enumerate(res["losses"]):
            for t, loss in enumerate(step):
                want = plain.losses[s][t][r]
                if not math.isfinite(want):  # the plain loop's poisoned loss
                    continue
                assert abs(loss - want) <= tol * max(abs(want), 1.0), (
                    f"rank {r}, step {s + 1}, micro-batch {t}: loss {loss!r} vs plain {want!r}"
                )
        assert res["lrs"] == plain.lrs, f"rank {r}: lr {res['lrs']} vs plain {plain.lrs}"
        # Buffers ``own_buffers`` are each rank's own (parameter servers' async and ssp
        # workers): rank 0's count, as in a checkpoint.
        skip = own_buffers if r else frozenset()
        diff = reference.max_rel_diff(
            {k: v for k, v in res["state"].items() if k not in skip},
            {k: v for k, v in plain.state.items() if k not in skip},
        )
        assert diff <= tol, f"rank {r}: parameters/buffers differ by {diff:.3g} (rel)"
    optim = assemble(results)
    assert optim.keys() == plain.optim.keys(), (
        f"parameters with optimizer state differ: longboat only {set(optim) - set(plain.optim)}"
        f", plain only {set(plain.optim) - set(optim)}"
    )
    for name, want in plain.optim.items():
        got = optim[name]
        assert got.keys() == want.keys(), f"{name}: state keys {set(got)} vs {set(want)}"
        for k, v in want.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                d = reference.max_rel_diff({k: got[k]}, {k: v})
                assert d <= tol, f"optimizer state {name}.{k} differs by {d:.3g} (rel)"
            else:
                v = v.item() if isinstance(v, torch.Tensor) else v
                assert got[k] == v, f"optimizer state {name}.{k}: {got[k]} vs plain {v}"


def servers_in(strategy: dict[str, Any]) -> bool:
    return strategy.get("strategy") == "parameter_server"


def run_and_compare(
    ranks: Any,
    world: int,
    strategy: dict[str, Any],
    recipe: reference.Recipe,
    steps: int,
    accum: int,
    global_batch: int,
    tol: float,
    poison: tuple[int, int] | None = None,
    poison_how: str = "loss",
    own_buffers: bool = False,
    **extra: Any,
) -> tuple[list[dict[str, Any]], reference.PlainRun]:
    """Train on ``world`` ranks, replay the same samples through the plain loop (which meets
    a poisoned step as an inf loss), compare. With parameter servers, the last ``servers`` of
    the ranks serve and the others are compared."""
    servers = strategy.get("parameter_server", {}).get("servers", 1) if servers_in(strategy) else 0
    micro = global_batch // ((world - servers) * accum)
    cfg = config(strategy, recipe, global_batch, micro, **extra)
    everyone = ranks(world, train, recipe, cfg, steps, poison=poison, poison_how=poison_how)
    results = [r for r in everyone if "served" not in r]
    assert len(results) == world - servers
    order = order_of(results)
    seen = [i for step in order for micro_ids in step for ids in micro_ids for i in ids]
    assert len(seen) == len(set(seen)) == global_batch * steps, "each sample once per epoch"
    plain = reference.plain_train(recipe, data_for(recipe, global_batch * steps), order, poison)
    buffers = frozenset(n for n, _ in recipe.build()[0].named_buffers()) if own_buffers else None
    compare(results, plain, tol, buffers or frozenset())
    return results, plain


def longboat_run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``longboat run ...`` with stdout and stderr together; on a timeout its whole process
    group is killed and the test fails with what it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "longboat.cli", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"longboat run timed out after {timeout} s:\n{out}")
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def save_or_load(cfg: dict, directory: str, steps: int) -> dict:
    """Train ``steps`` steps and save (steps > 0), or load the latest checkpoint; the state
    the engine holds then, and its optimizer state as checkpoint pieces."""
    recipe = reference.Recipe(model="zoo", optimizer="adamw")
    model, opt, _ = recipe.build()
    try:
        engine = longboat.initialize(model, opt, cfg)
    except longboat.ps.ServerExit as served:
        return {"served": served.summary}
    if steps:
        data = data_for(recipe, engine.batch.train_batch_size * steps)
        for batch in engine.loader(data):
            _, *rest = batch
            engine.backward(reference.forward_loss(engine, rest))
            if engine.step() and engine.global_step == steps:
                break
        engine.save_checkpoint(directory, "saved")
    else:
        engine.load_checkpoint(directory, "saved")
    out = {
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": optimizer_pieces(engine),
    }
    engine.close()
    return out


# Small buckets and per-module units: many buckets and units whose sizes divide no world size.
ZOO_STRATEGIES: dict[str, dict] = {
    "replicate": {
        "strategy": "replicate",
        "replicate": {"bucket_mb": 0.0005, "first_bucket_mb": 0.0002},
    },
    "zero1": {"strategy": "zero", "zero": {"stage": 1, "bucket_mb": 0.0005}},
    "zero2": {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.0005}},
    # The experts run on some ranks only, so their unit is the module that holds them all and
    # runs everywhere (see docs: units must run on every rank); the tied pair and the rest sit
    # in the root unit.
    "zero3": {
        "strategy": "zero",
        "zero": {"stage": 3, "unit_classes": ["Experts", "LSTM", "BatchNorm1d"]},
    },
}


def train_self_reducing(
    cfg: dict[str, Any],
    recipe: reference.Recipe,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    global_batch: int,
    steps: int,
) -> dict[str, Any]:
    """``steps`` steps of an optimizer that reduces itself (1-bit Adam, 1-bit LAMB) under
    ``cfg``: the sample ids and loss of every step, what the optimizer's ``get_lamb_coeffs``
    said after it (where it has one), the final state and optimizer pieces, and whether the
    strategy left the last step's gradients local."""
    model, _, _ = recipe.build()
    opt = make_optimizer(model.parameters())
    engine = longboat.initialize(model, opt, cfg)
    ids, losses, coeffs = [], [], []
    for sample_ids, *batch in engine.loader(data_for(recipe, global_batch * steps)):
        loss = reference.forward_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        ids.append(sample_ids.tolist())
        losses.append(float(loss.detach()))
        coeffs.append(opt.get_lamb_coeffs() if hasattr(opt, "get_lamb_coeffs") else None)
        if engine.global_step == steps:
            break
    out = {
        "ids": ids,
        "losses": losses,
        "coeffs": coeffs,
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": optimizer_pieces(engine),
        "local": engine.strategy.name == "replicate" and engine.strategy._local,
    }
    engine.close()
    return out


def check_simulated(
    results: list[dict[str, Any]],
    simulated: tuple[list[list[float]], dict[str, torch.Tensor], dict[str, dict[str, Any]]],
    keys: tuple[str, ...],
    tol: float,
) -> None:
    """Every rank's loss at every step, then its parameters and buffers, then the optimizer
    state assembled from every rank (``step`` and ``keys``), against a simulation's (losses
    [step][rank], state_dict, optimizer state by parameter name); relative tolerance ``tol``."""
    losses, state, optim = simulated
    for r, res in enumerate(results):
        for s, loss in enumerate(res["losses"]):
            want = losses[s][r]
            assert abs(loss - want) <= tol * max(abs(want), 1.0), (
                f"rank {r}, step {s + 1}: loss {loss!r} vs simulated {want!r}"
            )
        diff = reference.max_rel_diff(res["state"], state)
        assert diff <= tol, f"rank {r}: parameters/buffers differ by {diff:.3g} (rel)"
    got = assemble(results)
    assert got.keys() == optim.keys()
    for name, want in optim.items():
        assert int(got[name]["step"]) == want["step"], name
        for k in keys:
            d = reference.max_rel_diff({k: torch.as_tensor(got[name][k])}, {k: want[k]})
            assert d <= tol, f"optimizer state {name}.{k} differs by {d:.3g}"


DIGITS = Path(__file__).resolve().parents[1] / "examples"
DIGITS_OPTIMIZER = 'type = "AdamW"\nparams = { lr = 3e-3, weight_decay = 1e-4 }'


def _digits_main(script: str, config: str) -> str:
    """On a pool rank: the digits example run as ``python digits.py --config CONFIG`` would
    run it (its ``__main__``, its argument parser); what it printed and logged."""
    printed = io.StringIO()
    logged = logging.StreamHandler(printed)
    logging.getLogger("longboat").addHandler(logged)
    argv, sys.argv = sys.argv, [script, "--config", config]
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = argv
        logging.getLogger("longboat").removeHandler(logged)
    return printed.getvalue()


def digits_accuracy(ranks: Any, directory: Path, name: str, config: str) -> tuple[float, str]:
    """The digits example's script trained at 2 ranks with ``config`` (a variant of
    ``examples/digits.toml``, written to ``directory/name.toml``): its final accuracy and rank
    0's output. On the rank pool: the launcher adds nothing to what converges, and
    tests/test_example.py runs the example under ``longboat run``."""
    path = directory / f"{name}.toml"
    path.write_text(config)
    out = ranks(2, _digits_main, str(DIGITS / "digits.py"), str(path), timeout=300)[0]
    m = re.search(r"accuracy=([0-9.]+)", out)
    assert m, out[-3000:]
    return float(m.group(1)), out


def digits_config(optimizer: str | None = None, extra: str = "") -> str:
    """``examples/digits.toml`` with its optimizer lines replaced by ``optimizer`` (when given)
    and ``extra`` appended."""
    toml = (DIGITS / "digits.toml").read_text()
    assert DIGITS_OPTIMIZER in toml
    if optimizer is not None:
        toml = toml.replace(DIGITS_OPTIMIZER, optimizer)
    return toml + extra


def assert_saved_state_matches_plain(
    got: dict[str, torch.Tensor], plain: reference.PlainRun, tol: float
) -> None:
    """A rank's saved ``model.*`` and ``optim.*`` tensors against the plain loop's parameters,
    buffers and optimizer state (step counts exactly, the rest within ``tol``)."""
    model = {k.removeprefix("model."): v for k, v in got.items() if k.startswith("model.")}
    assert reference.max_rel_diff(model, plain.state) <= tol
    optim = {
        f"optim.{name}.{k}": torch.as_tensor(v)
        for name, st in plain.optim.items()
        for k, v in st.items()
    }
    assert optim.keys() == {k for k in got if k.startswith("optim.")}
    for k, want in optim.items():
        if want.dim() == 0:  # Adam's step count
            assert got[k].item() == want.item(), k
        else:
            assert reference.max_rel_diff({k: got[k]}, {k: want}) <= tol, k
