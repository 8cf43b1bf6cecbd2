"""``torch.compile`` under every strategy against the plain (uncompiled) PyTorch loop of
``reference.py``: a model compiled by the user and passed to ``initialize``, and the config's
``[compile]`` section, which compiles block by block. Also: names and checkpoints are those of
the uncompiled model, and bad settings or a failing backend are named errors on every rank.

Most runs use the ``aot_eager`` backend (dynamo and autograd's tracing without code generation,
which on a CPU means building C++); one runs inductor itself.
"""

from __future__ import annotations

from typing import Any

import harness
import pytest
import reference
import test_pipeline
import test_tensor_parallel
import torch
from torch._dynamo.utils import counters

import longboat
from longboat.compile import CompileError
from longboat.config import load_config

STEPS = 3
GLOBAL_BATCH = 16
AOT = {"enabled": True, "backend": "aot_eager"}

STRATEGIES: dict[str, dict[str, Any]] = {
    "replicate": {"strategy": "replicate"},
    "zero1": {"strategy": "zero", "zero": {"stage": 1, "bucket_mb": 0.001}},
    "zero2": {"strategy": "zero", "zero": {"stage": 2, "bucket_mb": 0.001}},
    # several units, each its own gather hooks: what the compiled model once failed on
    "zero3": {"strategy": "zero", "zero": {"stage": 3, "unit_classes": ["Linear", "LayerNorm"]}},
}


def _fresh() -> None:
    """Forget what earlier tests compiled in this rank (caches, recompile counts, counters)."""
    torch._dynamo.reset()
    counters.clear()


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _train(
    recipe: reference.Recipe, cfg: dict[str, Any], steps: int, compiled: dict[str, Any] | None
) -> dict[str, Any]:
    """``harness.train``'s run, the model passed to ``initialize`` compiled by
    ``torch.compile(model, **compiled)`` when given; also the graphs dynamo made."""
    _fresh()
    model, opt, sched = recipe.build()
    if torch.distributed.get_rank():
        with torch.no_grad():  # the strategy must start every rank from rank 0's weights
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    engine = longboat.initialize(
        torch.compile(model, **compiled) if compiled is not None else model,
        opt,
        cfg,
        scheduler=sched,
    )
    data = harness.data_for(recipe, engine.batch.train_batch_size * steps)
    ids: list[list[list[int]]] = []
    losses: list[list[float]] = []
    lrs: list[float] = []
    step_ids: list[list[int]] = []
    step_losses: list[float] = []
    for sample_ids, *rest in engine.loader(data):
        loss = reference.forward_loss(engine, rest)
        engine.backward(loss)
        step_ids.append(sample_ids.tolist())
        step_losses.append(float(loss.detach()))
        if engine.step():
            ids.append(step_ids)
            losses.append(step_losses)
            lrs.append(opt.param_groups[0]["lr"])
            step_ids, step_losses = [], []
            if engine.global_step == steps:
                break
    out = {
        "ids": ids,
        "losses": losses,
        "lrs": lrs,
        "skipped": [],
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
        "graphs": _graphs(),
    }
    engine.close()
    return out


def _compare(
    ranks: Any,
    world: int,
    strategy: dict[str, Any],
    recipe: reference.Recipe,
    accum: int,
    compiled: dict[str, Any] | None = None,
    **extra: Any,
) -> None:
    micro = GLOBAL_BATCH // (world * accum)
    cfg = harness.config(strategy, recipe, GLOBAL_BATCH, micro, **extra)
    results = ranks(world, _train, recipe, cfg, STEPS, compiled)
    order = harness.order_of(results)
    plain = reference.plain_train(recipe, harness.data_for(recipe, GLOBAL_BATCH * STEPS), order)
    harness.compare(results, plain, 1e-5)
    # compiled indeed, not fallen back to eager (which would equal the plain loop as well)
    assert all(r["graphs"] > 0 for r in results), [r["graphs"] for r in results]


# -- a model compiled by the user ------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_compiled_model_trains_as_the_plain_loop(ranks, strategy):
    recipe = reference.Recipe(model="tiny", optimizer="adamw", clip=0.5)
    _compare(ranks, 2, STRATEGIES[strategy], recipe, 2, compiled={"backend": "aot_eager"})


def test_a_compiled_model_under_zero3_with_inductor(ranks):
    # The failure first seen: inductor's graph read the units' parameters before their gather.
    recipe = reference.Recipe(model="tiny", optimizer="adamw")
    _compare(ranks, 2, STRATEGIES["zero3"], recipe, 1, compiled={})


# -- the config's [compile] section --------------------------------------------------------


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_compile_section_trains_as_the_plain_loop(ranks, strategy):
    recipe = reference.Recipe(model="tiny", optimizer="adamw", clip=0.5)
    _compare(ranks, 2, STRATEGIES[strategy], recipe, 2, compile=AOT)


def test_compile_section_under_hybrid_sharding(ranks):
    recipe = reference.Recipe(model="tiny", optimizer="sgd", clip=0.5)
    mesh = {"mesh": {"dp_replicate": 2, "dp_shard": 2}}
    _compare(ranks, 4, STRATEGIES["zero3"], recipe, 1, compile=AOT, **mesh)


def test_compile_section_with_pipeline_stages(ranks):
    ranks(2, _fresh)
    test_pipeline._run(ranks, 2, {"mesh": {"pp": 2}, "compile": AOT}, accum=4)
    assert all(n > 0 for n in ranks(2, _graphs))


def test_compile_section_with_tensor_parallel(ranks):
    ranks(2, _fresh)
    cfg = test_tensor_parallel._config({"mesh": {"tp": 2}, "compile": AOT})
    results = ranks(2, test_tensor_parallel._train, cfg, test_tensor_parallel.STEPS, False)
    assert all(n > 0 for n in ranks(2, _graphs))
    plain, model, _, norm = test_tensor_parallel._plain(
        test_tensor_parallel.STEPS, False, test_tensor_parallel.BATCH // 2
    )
    for r in results:
        assert r["losses"] == pytest.approx(plain, rel=1e-5)
        assert r["norm"] == pytest.approx(norm, rel=1e-5)
        assert reference.max_rel_diff(r["state"], model.state_dict()) <= 1e-5


def _compiled_blocks(cfg: dict[str, Any], compiled: bool) -> list[str]:
    """The modules the engine compiled, by their names."""
    _fresh()
    recipe = reference.Recipe(model="tiny")
    model, opt, _ = recipe.build()
    engine = longboat.initialize(torch.compile(model) if compiled else model, opt, cfg)
    names = {id(m): n for n, m in engine.model.named_modules()}
    assert engine.compiler is not None
    out = [names[id(m)] for m, _ in engine.compiler.compiled]
    engine.close()
    assert all(m._compiled_call_impl is None for m in model.modules()), "close() restores"
    return out


def test_blocks_are_zero3_units_the_named_classes_or_the_whole_model(ranks):
    quiet = {**harness.QUIET, "batch": {"micro_batch_size": 4}}
    zero3 = {**quiet, **STRATEGIES["zero3"]}
    assert ranks(2, _compiled_blocks, {**zero3, "compile": AOT}, False)[0] == [
        "inp",
        "norm",
        "mid",
        "out",
    ]
    named = {**quiet, "compile": {**AOT, "classes": ["LayerNorm"]}}
    assert ranks(2, _compiled_blocks, named, False)[0] == ["norm"]
    assert ranks(2, _compiled_blocks, {**quiet, "compile": AOT}, False)[0] == [""]
    # a model compiled by the user: the module trained, whole
    assert ranks(2, _compiled_blocks, zero3, True)[0] == [""]


# -- names and checkpoints ---------------------------------------------------------------------


def _save_or_load(cfg: dict[str, Any], directory: str, steps: int, compiled: bool) -> dict:
    _fresh()
    recipe = reference.Recipe(model="tiny", optimizer="adamw")
    model, opt, _ = recipe.build()
    engine = longboat.initialize(
        torch.compile(model, backend="aot_eager") if compiled else model, opt, cfg
    )
    if steps:
        data = harness.data_for(recipe, engine.batch.train_batch_size * steps)
        for _, *rest in engine.loader(data):
            engine.backward(reference.forward_loss(engine, rest))
            if engine.step() and engine.global_step == steps:
                break
        engine.save_checkpoint(directory, "saved")
    else:
        engine.load_checkpoint(directory, "saved")
    out = {
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
        "names": [n for n, _ in engine.model.named_parameters()],
    }
    engine.close()
    return out


@pytest.mark.parametrize("saved_compiled", [True, False], ids=["compiled-saves", "plain-saves"])
def test_checkpoints_load_across_compiled_and_plain(ranks, tmp_path, saved_compiled):
    cfg = {**harness.QUIET, **STRATEGIES["zero3"], "batch": {"micro_batch_size": 4}}
    saved = ranks(2, _save_or_load, cfg, str(tmp_path), 2, saved_compiled)
    loaded = ranks(2, _save_or_load, cfg, str(tmp_path), 0, not saved_compiled)
    names = [n for n, _ in reference.TinyNet().named_parameters()]
    for s, t in zip(saved, loaded, strict=True):
        assert s["names"] == t["names"] == names  # the user's own: no "_orig_mod." anywhere
        assert list(s["state"]) == list(t["state"]) == list(reference.TinyNet().state_dict())
        assert reference.max_rel_diff(t["state"], s["state"]) == 0.0
    want, got = harness.assemble(saved), harness.assemble(loaded)
    assert got.keys() == want.keys()
    for name, state in want.items():
        assert torch.equal(got[name]["exp_avg"], state["exp_avg"]), name
        assert got[name]["step"] == state["step"], name


# -- errors ------------------------------------------------------------------------------------


def _initialize_error(cfg: dict[str, Any], compiled: dict[str, Any] | None = None) -> str:
    """What ``initialize`` (or the first training step) raised on this rank."""
    _fresh()
    if "longboat_test_failing" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_failing, name="longboat_test_failing")
    recipe = reference.Recipe(model="tiny")
    model, opt, _ = recipe.build()
    engine = None
    try:
        engine = longboat.initialize(
            torch.compile(model, **compiled) if compiled is not None else model, opt, cfg
        )
        x, y = reference.dataset(4)[:]
        engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
        engine.step()
    except longboat.ConfigError as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, CompileError):
            cause = cause.__cause__  # another check may name the failed forward first
        return str(cause or e)
    finally:
        if engine is not None:
            engine.close()
    return "no error"


def _failing(gm: Any, inputs: Any) -> Any:
    raise RuntimeError("this backend always fails")


@pytest.mark.parametrize(
    ("section", "compiled", "words"),
    [
        ({"mode": "fastest"}, None, ["'compile.mode' = 'fastest'", "max-autotune"]),
        ({"backend": "no_such_backend"}, None, ["compile.backend = 'no_such_backend'"]),
        (
            {"backend": "longboat_test_failing"},
            None,
            ["module 'inp' (Linear)", "compile.backend = 'longboat_test_failing'", "always fails"],
        ),
        ({"fullgraph": True}, None, ["fullgraph", "module 'inp' (Linear)", "hooks"]),
        (None, {"fullgraph": True}, ["torch.compile(model)", "fullgraph", "classes = [...]"]),
        ({}, {}, ["compiled already", "compile.enabled"]),
    ],
    ids=["mode", "backend", "failing-backend", "fullgraph", "compiled-fullgraph", "twice"],
)
def test_compile_errors_name_the_key_on_every_rank(ranks, section, compiled, words):
    cfg = {**harness.QUIET, **STRATEGIES["zero3"], "batch": {"micro_batch_size": 4}}
    if section is not None:
        cfg["compile"] = {**AOT, **section}
    errors = ranks(2, _initialize_error, cfg, compiled, timeout=60)
    for e in errors:  # every rank, at the same point: none waits for the other
        assert all(w in e for w in words), e


def test_the_switch_and_the_deepspeed_block():
    assert load_config({"compile": True}).compile.enabled
    ds = load_config(
        {
            "train_batch_size": 8,
            "compile": {"enabled": True, "backend": "aot_eager", "kwargs": {"dynamic": False}},
        }
    ).compile
    assert (ds.enabled, ds.backend, ds.dynamic) == (True, "aot_eager", False)
    with pytest.raises(longboat.ConfigError, match=r"compile\.deepcompile"):
        load_config({"train_batch_size": 8, "compile": {"deepcompile": True}})
    with pytest.raises(longboat.ConfigError, match=r"mode.*options"):
        load_config({"compile": {"mode": "max-autotune", "options": {"trace.enabled": True}}})


def test_on_a_torch_without_a_per_function_limit_the_global_one_is_raised(monkeypatch):
    # torch 2.11 (a lent GPU machine's) refused torch.compile(..., recompile_limit=...)
    import torch._dynamo

    import longboat.compile as lc

    seen: dict[str, Any] = {}

    def fake_compile(fn, **kwargs):
        seen.update(kwargs)
        return fn

    name = lc._LIMIT
    monkeypatch.setattr(lc, "_TAKES_LIMIT", False)
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch._dynamo.config, name, 8)
    cfg = load_config({"compile": {"enabled": True, "backend": "eager"}}).compile
    compiler = lc.Compiler.plan(cfg, None)
    assert compiler is not None
    compiler.wrap(lambda x: x, 40)
    assert "recompile_limit" not in seen and getattr(torch._dynamo.config, name) == 40
    compiler.wrap(lambda x: x, 4)  # never lowered
    assert getattr(torch._dynamo.config, name) == 40
