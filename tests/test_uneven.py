"""Uneven inputs ([Note: joining] in longboat/join.py): ranks that hold different numbers of
batches under ``data.remainder = 'join'`` finish together, without hanging, and train what the
plain loop of ``reference.py`` trains when each micro-batch's gradient is averaged over the
ranks that had samples in it: every micro-batch's loss, then parameters, buffers, optimizer
state and learning rate, on the model with conditionally used, never-used, frozen and tied
parameters, with accumulation and clipping. Without the policy the rank that ran out is named.
"""

from __future__ import annotations

import csv
import logging

import harness
import pytest
import reference
import torch

import longboat
from longboat.config import load_config
from longboat.testing import RankFailure

TOL = 1e-5  # fp32, relative, as the equivalence tests
MICRO = 2  # samples per rank per micro-batch
ACCUM = 2
BATCHES = 8  # micro-batches on a full rank: 4 steps
FEWER = 3  # the short rank runs out inside step 3 and shadows the rest of it and step 4

STRATEGIES = {"single": {"strategy": "single"}, **harness.ZOO_STRATEGIES}
# ZeRO-3 within pairs of ranks, replicated across the pairs ([Note: hybrid sharding]).
STRATEGIES["zero3-hybrid"] = {**STRATEGIES["zero3"], "mesh": {"dp_replicate": 2}}

RECIPE = reference.Recipe(model="zoo", optimizer="adamw", clip=1.0, scheduler=True)


def _config(strategy: str, world: int, **extra: object) -> dict:
    return harness.config(
        STRATEGIES[strategy],
        RECIPE,
        MICRO * ACCUM * world,
        MICRO,
        data={"remainder": "join"},
        **extra,
    )


def _record(engine: longboat.Engine) -> list[float]:
    """The learning rate after every step, the steps a joined rank takes inside the loop
    included (the engine's own step() call finds this wrapper on the instance)."""
    lrs: list[float] = []
    step = engine.step

    def recorded() -> bool:
        done = step()
        if done:
            lrs.append(engine.optimizer.param_groups[0]["lr"])
        return done

    engine.step = recorded  # type: ignore[method-assign]
    return lrs


def _result(engine: longboat.Engine, seen: dict, lrs: list[float]) -> dict:
    """What harness.compare reads, with [step][micro] sample ids (empty: no batch here)."""
    steps = engine.global_step
    a = engine.accumulation_steps
    out = {
        "ids": [
            [seen[(s, t)][0] if (s, t) in seen else [] for t in range(a)] for s in range(steps)
        ],
        "losses": [[seen[(s, t)][1] for t in range(a) if (s, t) in seen] for s in range(steps)],
        "lrs": lrs,
        "skipped": [],
        "scales": [],
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
        "steps": steps,
        "shadowed": engine.micro_step - len(seen),
    }
    engine.close()
    return out


def _shard(world: int, rank: int) -> list[list[int]]:
    """Rank ``rank``'s micro-batches of a full run: what it would get from a shuffled loader."""
    order = torch.randperm(MICRO * world * BATCHES, generator=torch.Generator().manual_seed(3))
    return [
        order[(t * world + rank) * MICRO : (t * world + rank + 1) * MICRO].tolist()
        for t in range(BATCHES)
    ]


def _train_uneven(cfg: dict, counts: list[int]) -> dict:
    """Train on this rank's ``counts[rank]`` micro-batches through ``engine.join``."""
    model, opt, sched = RECIPE.build()
    rank = torch.distributed.get_rank()
    if rank:
        with torch.no_grad():  # every rank must start from rank 0's weights
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    engine = longboat.initialize(model, opt, cfg, scheduler=sched)
    data = harness.data_for(RECIPE, MICRO * len(counts) * BATCHES)
    mine = [data[ids] for ids in _shard(len(counts), rank)[: counts[rank]]]
    lrs = _record(engine)
    seen: dict[tuple[int, int], tuple[list[int], float]] = {}
    for ids, *batch in engine.join(mine):
        where = (engine.global_step, engine.micro_step % engine.accumulation_steps)
        loss = reference.forward_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        seen[where] = (ids.tolist(), float(loss.detach()))
    return _result(engine, seen, lrs)


def _compare(results: list[dict], data_size: int) -> reference.PlainRun:
    steps = {res["steps"] for res in results}
    assert len(steps) == 1, f"the ranks left the loop after different steps: {steps}"
    order = harness.order_of(results)
    plain = reference.plain_train(RECIPE, harness.data_for(RECIPE, data_size), order)
    harness.compare(results, plain, TOL)
    return plain


def _cases():
    yield "single", 1
    for name in ("replicate", "zero1", "zero2", "zero3"):
        for world in (2, 4):
            yield name, world
    yield "zero3-hybrid", 4


@pytest.mark.parametrize(("strategy", "world"), list(_cases()))
def test_short_rank_joins_and_equals_plain_pytorch(ranks, tmp_path, strategy, world):
    """One rank has 3 fewer micro-batches (rank 0 at 2 ranks, so whose buffers count changes
    hands; rank 1 at 4): it runs out inside a step, shadows the rest of it and a whole step,
    and every rank leaves the loop after the same step with what the plain loop computes when
    each micro-batch is averaged over the ranks that had one; the monitor's loss of a step is
    the mean over the ranks that had a loss in it. At one rank, the last step is half full and
    is finished and taken."""
    short = 0 if world <= 2 else 1
    counts = [BATCHES] * world
    counts[short] -= FEWER
    sink = {"enabled": True, "output_path": str(tmp_path)}
    cfg = _config(strategy, world, monitor={"csv": sink})
    results = ranks(world, _train_uneven, cfg, counts, timeout=120)
    plain = _compare(results, MICRO * world * BATCHES)
    assert results[0]["steps"] == -(-max(counts) // ACCUM)
    # The short rank shadowed the 3 micro-batches it lacked (alone: the half step's second).
    shadows = [FEWER if r == short else 0 for r in range(world)] if world > 1 else [1]
    assert [res["shadowed"] for res in results] == shadows
    if world > 1:
        for res in results:  # every rank holds the same parameters and buffers
            for k, v in res["state"].items():
                assert torch.equal(v, results[0]["state"][k]), k
        # The run met what it is about: the short rank missing from a micro-batch inside a
        # step it began, and from a whole step.
        missing = [[not ids[short] for ids in step] for step in harness.order_of(results)]
        assert [False, True] in missing and [True, True] in missing, missing
    else:  # one rank, 5 micro-batches of 2 per step: the third step had one
        assert [len(ids[0]) for ids in harness.order_of(results)[-1]] == [MICRO, 0]
    with (tmp_path / "longboat" / "metrics.csv").open() as f:
        logged = [float(row["loss"]) for row in csv.DictReader(f)]
    for s, loss in enumerate(logged):
        had = [sum(res["losses"][s]) / len(res["losses"][s]) for res in results if res["losses"][s]]
        assert loss == pytest.approx(sum(had) / len(had), rel=1e-6), (s, logged)
    # The zoo's never-used parameter and frozen layer never get a gradient, and the weight
    # decay never moves the never-used one either (its optimizer state never appears).
    assert "never" not in plain.optim and "frozen.weight" not in plain.optim


def _train_loader(cfg: dict, epochs: int, size: int) -> dict:
    """``engine.loader`` under the policy: a data set whose last step does not fill the ranks,
    for ``epochs`` epochs, with the log captured."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("longboat").addHandler(handler)
    try:
        model, opt, sched = RECIPE.build()
        engine = longboat.initialize(model, opt, cfg, scheduler=sched)
        lrs = _record(engine)
        loader = engine.loader(harness.data_for(RECIPE, size))
        seen: dict[tuple[int, int], tuple[list[int], float]] = {}
        for _ in range(epochs):
            for ids, *batch in loader:
                where = (engine.global_step, engine.micro_step % engine.accumulation_steps)
                loss = reference.forward_loss(engine, batch)
                engine.backward(loss)
                engine.step()
                seen[where] = (ids.tolist(), float(loss.detach()))
        out = _result(engine, seen, lrs)
    finally:
        logging.getLogger("longboat").removeHandler(handler)
    out["log"] = records
    out["epoch"] = loader.epoch
    return out


def test_engine_loader_keeps_the_last_samples_and_ranks_join(ranks):
    """``data.remainder = 'join'``: the epoch's last 9 samples of 2 ranks x 2 x 4 fall 5 to rank
    0 (a full micro-batch and one of 1 sample) and 4 to rank 1 (one micro-batch), which joins
    for the last one; over two epochs every sample is seen once per epoch, the run equals the
    plain loop, and the log says what happens and when rank 1 runs out."""
    world, micro, steps_full = 2, 4, 2
    size = micro * ACCUM * world * steps_full + 9
    cfg = harness.config(
        STRATEGIES["replicate"],
        RECIPE,
        micro * ACCUM * world,
        micro,
        data={"remainder": "join", "shuffle": True},
        log={"progress": False, "level": "INFO"},
    )
    results = ranks(world, _train_loader, cfg, 2, size, timeout=120)
    plain = _compare(results, size)
    assert plain is not None and results[0]["steps"] == 2 * (steps_full + 1)
    order = harness.order_of(results)
    for epoch in (order[:3], order[3:]):
        ids = [
            i for step in epoch for micro_ids in step for rank_ids in micro_ids for i in rank_ids
        ]
        assert sorted(ids) == list(range(size)), "each sample once per epoch"
        assert [len(x) for x in epoch[-1][0]] == [4, 4] and [len(x) for x in epoch[-1][1]] == [1, 0]
    assert all(res["epoch"] == 2 for res in results)
    log = results[0]["log"]  # rank 0's view (info lines show on rank 0 only)
    assert any("data.remainder='join'" in line and "shadows" in line for line in log), log
    assert any("2, 1 micro-batch(es) on ranks 0..1" in line for line in log), log
    ran_out = (
        "rank 1 ran out of batches in step 3, after 1 of its 2 micro-batches; it shadows the "
        "others' collectives with zero contributions until all are done"
    )
    assert ran_out in log, log
    assert sum("rank 1 ran out of batches" in line for line in log) == 2, log  # once per epoch


def _train_without_policy(cfg: dict, counts: list[int]) -> None:
    model, opt, _ = RECIPE.build()
    engine = longboat.initialize(model, opt, cfg)
    rank = torch.distributed.get_rank()
    data = harness.data_for(RECIPE, MICRO * len(counts) * BATCHES)
    for ids in _shard(len(counts), rank)[: counts[rank]]:
        _, *batch = data[ids]
        engine.backward(reference.forward_loss(engine, batch))
        engine.step()
    # The short rank leaves here (without the collective close: as a script that moves on)


def test_without_the_policy_the_rank_that_ran_out_is_named(ranks):
    """Under the default ``data.remainder = 'drop'`` a rank with fewer batches leaves the loop
    while the other waits in its gradient collective: after ``comm.timeout_s`` the waiting rank
    names it and says what would have joined it."""
    cfg = harness.config(STRATEGIES["replicate"], RECIPE, MICRO * 2, MICRO, comm={"timeout_s": 2.0})
    with pytest.raises(RankFailure) as info:
        ranks(2, _train_without_policy, cfg, [BATCHES, BATCHES - FEWER], timeout=60)
    text = str(info.value)
    assert "CollectiveTimeout" in text and "rank(s) 1 did not arrive" in text, text[-3000:]
    assert "data.remainder = 'join'" in text, text[-3000:]


# -- refused, by name ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"strategy": "parameter_server"}, "strategy 'parameter_server': async and ssp"),
        ({"mesh": {"pp": 2}}, "mesh.pp = 2: a pipeline runs whole steps"),
        ({"mesh": {"tp": 2}}, "mesh.tp = 2: the tensor-parallel peers"),
        ({"sync_batchnorm": True}, "sync_batchnorm: its statistics are all-reduced"),
    ],
)
def test_join_is_refused_where_ranks_cannot_shadow(extra, named):
    with pytest.raises(longboat.ConfigError) as info:
        load_config({"data": {"remainder": "join"}, **extra})
    text = str(info.value)
    assert named in text and "data.remainder = 'pad'" in text, text
    load_config({"data": {"remainder": "pad"}, **extra})  # padding is the other choice


def test_a_bad_value_names_the_key_and_the_choices():
    with pytest.raises(longboat.ConfigError) as info:
        load_config({"data": {"remainder": "joins"}})
    assert "'data.remainder'" in str(info.value) and "'pad' or 'join'" in str(info.value)


def test_join_calls_without_the_policy_or_with_whole_steps_are_refused():
    model, opt, _ = RECIPE.build()
    quiet = {"log": {"progress": False, "level": "WARNING"}, "batch": {"micro_batch_size": 2}}
    with (
        longboat.initialize(model, opt, {**quiet}) as engine,
        pytest.raises(longboat.ConfigError, match=r"set data\.remainder = 'join'"),
    ):
        engine.join([])
    model, opt, _ = RECIPE.build()
    cfg = {**quiet, "data": {"remainder": "join"}}
    with longboat.initialize(model, opt, cfg) as engine:
        with pytest.raises(longboat.ConfigError, match="per_step=True"):
            engine.loader(harness.data_for(RECIPE, 8), per_step=True)
        with pytest.raises(longboat.ConfigError, match="train_step"):
            engine.train_step(torch.zeros(2, 3), lambda out, mb: out.sum())
