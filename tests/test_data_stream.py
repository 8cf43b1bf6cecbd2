"""Data as scripts bring it ([Note: streams] and [Note: your DataLoader] in longboat/data/): a
stream (``IterableDataset``) split by rank and worker so that every sample of an epoch is read
by exactly one rank, ``set_epoch`` reaching every reader, training equal to the plain loop of
``reference.py`` on the samples each rank should have had (computed here from the stream, not
taken from the run), resuming mid-epoch; and a ``DataLoader`` built with a ``DistributedSampler``
used as it is, not sharded twice, refused on every rank where it disagrees with the mesh.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
from collections.abc import Iterator

import harness
import pytest
import reference
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    TensorDataset,
    get_worker_info,
)

import longboat
from longboat.config import ConfigError
from longboat.data import (
    UserLoader,
    dataloader_problem,
    make_loader,
    make_stream_loader,
    refusal,
)
from longboat.testing import RankFailure

TOL = 1e-5  # fp32, relative, as the equivalence tests
RECIPE = reference.Recipe(model="tiny", optimizer="adamw", clip=1.0, scheduler=True)


class Stream(IterableDataset):
    """The samples of ``data`` in an order drawn from ``seed`` and the epoch, as a seeded
    streaming shuffle gives (``seed=None``: in index order); it counts ``set_epoch`` calls."""

    def __init__(self, data: TensorDataset, seed: int | None = 7) -> None:
        self.data = data
        self.seed = seed
        self.epoch = 0
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs.append(epoch)

    @staticmethod
    def order(size: int, epoch: int, seed: int | None = 7) -> list[int]:
        if seed is None:
            return list(range(size))
        return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()

    def __iter__(self):
        for i in self.order(len(self.data), self.epoch, self.seed):
            yield self.data[i]


class SplitsItself(IterableDataset):
    """0..n-1, each worker process yielding only its share, as ``datasets`` and WebDataset
    do with torch's worker info."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        share = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        return iter(torch.tensor(i) for i in share)


class Noisy(IterableDataset):
    """0..n-1, each with a draw from torch's generator in the reading process."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.tensor([float(i), float(torch.rand(()))]) for i in range(self.n))


def expected(
    size: int, world: int, micro: int, accum: int, epochs: int, remainder: str, seed: int | None = 7
) -> list[list[list[list[int]]]]:
    """[step][micro][rank] -> sample ids each rank should see: the epoch's stream, trimmed or
    padded to whole steps by ``remainder``, position ``p`` to rank ``p % world``, micro-batch
    ``t`` its positions ``t*micro*world ...``; a step cut short by the end ('join') finished
    with empty micro-batches, as the join finishes it."""
    step, per = micro * accum * world, micro * world
    out = []
    for e in range(epochs):
        ids = Stream.order(size, e, seed)
        if remainder == "drop":
            ids = ids[: size // step * step]
        elif remainder == "pad" and size % step:
            ids = ids + (ids * step)[: step - size % step]
        micros = [
            [ids[t * per : (t + 1) * per][r::world] for r in range(world)]
            for t in range(-(-len(ids) // per))
        ]
        for s in range(0, len(micros), accum):
            part = micros[s : s + accum]
            out.append(part + [[[] for _ in range(world)]] * (accum - len(part)))
    return out


# -- on the ranks --------------------------------------------------------------------------------

STRATEGIES = {
    "replicate": {"strategy": "replicate"},
    **{f"zero{k}": {"strategy": "zero", "zero": {"stage": k}} for k in (1, 2, 3)},
}


@contextlib.contextmanager
def _forked_workers() -> Iterator[None]:
    """DataLoader workers started by fork, as in a script a launcher starts: the pool's ranks
    are spawned, and so would their workers be (seconds each, importing torch again)."""
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("fork", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(before, force=True)


def _bare_engine(cfg: dict) -> longboat.Engine:
    """An engine for reading batches only."""
    model = torch.nn.Linear(2, 2)
    return longboat.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)


def _read_epochs(cfg: dict, size: int, epochs: int) -> dict:
    """This rank's batches of sample ids in each of ``epochs`` epochs of a stream, read through
    ``engine.loader`` without training."""
    engine = _bare_engine(cfg)
    stream = Stream(reference.indexed(reference.dataset(size)))
    loader = engine.loader(stream)
    with _forked_workers():
        out = [[ids.tolist() for ids, _, _ in loader] for _ in range(epochs)]
    engine.close()
    return {"epochs": out, "set_epoch": stream.epochs}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("workers", [0, 2])
def test_each_sample_of_the_stream_goes_to_one_rank(ranks, world, workers):
    """Two epochs of 42 samples in micro-batches of 2, one per step: each rank gets exactly its
    positions of the epoch's order (with 2 workers per rank, kept across epochs, as without),
    the ranks together every sample of the whole steps once, and the next epoch the order
    ``set_epoch`` asked for, in every worker too."""
    size, micro = 42, 2
    workers_cfg = {"num_workers": workers, "persistent_workers": True} if workers else {}
    cfg = harness.config({}, RECIPE, micro * world, micro, data=workers_cfg)
    results = ranks(world, _read_epochs, cfg, size, 2, timeout=120)
    want = expected(size, world, micro, 1, 2, "drop")
    steps = size // (micro * world)
    for e in range(2):
        got = [res["epochs"][e] for res in results]
        assert got == [[s[0][r] for s in want[e * steps : (e + 1) * steps]] for r in range(world)]
        union = [i for rank in got for batch in rank for i in batch]
        assert len(union) == len(set(union)) == steps * micro * world, "each sample once"
        assert set(union) == set(Stream.order(size, e)[: steps * micro * world])
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
    assert all(res["set_epoch"] == [0, 1] for res in results)


def _record_lrs(engine: longboat.Engine) -> list[float]:
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


def _train(cfg: dict, size: int, epochs: int, stream: bool = True, seed: int | None = 7) -> dict:
    """``epochs`` epochs of training on a stream of ``size`` samples (or, ``stream=False``, on
    the same samples as a map-style data set), recorded as harness.compare reads it."""
    model, opt, sched = RECIPE.build()
    if torch.distributed.get_rank():
        with torch.no_grad():  # every rank must start from rank 0's weights
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    engine = longboat.initialize(model, opt, cfg, scheduler=sched)
    lrs = _record_lrs(engine)
    data = harness.data_for(RECIPE, size)
    loader = engine.loader(Stream(data, seed) if stream else data)
    seen: dict[tuple[int, int], tuple[list[int], float]] = {}
    with _forked_workers():
        for _ in range(epochs):
            for ids, *batch in loader:
                where = (engine.global_step, engine.micro_step % engine.accumulation_steps)
                loss = reference.forward_loss(engine, batch)
                engine.backward(loss)
                engine.step()
                seen[where] = (ids.tolist(), float(loss.detach()))
    a, steps = engine.accumulation_steps, engine.global_step
    out = {
        "ids": [[seen.get((s, t), ([], 0.0))[0] for t in range(a)] for s in range(steps)],
        "losses": [[seen[(s, t)][1] for t in range(a) if (s, t) in seen] for s in range(steps)],
        "lrs": lrs,
        "skipped": [],
        "scales": [],
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
    }
    engine.close()
    return out


@pytest.mark.parametrize(
    ("world", "workers", "remainder", "strategy"),
    [
        (2, 0, "drop", "replicate"),
        (4, 2, "drop", "zero2"),
        (2, 2, "pad", "zero1"),
        (2, 0, "join", "zero3"),
        (4, 0, "join", "replicate"),
    ],
)
def test_training_on_a_stream_equals_plain_pytorch(ranks, world, workers, remainder, strategy):
    """Three epochs of 2 steps and 5 samples on a stream whose order changes by epoch, 2
    micro-batches of 2 per step and rank: every rank sees the samples the stream's definition
    gives it ('drop': the 5 dropped; 'pad': padded from the epoch's start; 'join': kept, the
    short ranks joining), and every loss, the parameters, the optimizer state and the learning
    rate equal the plain loop's on those samples."""
    micro, accum = 2, 2
    size = micro * accum * world * 2 + 5
    workers_cfg = {"num_workers": workers} if workers else {}
    cfg = harness.config(
        STRATEGIES[strategy],
        RECIPE,
        micro * accum * world,
        micro,
        data={"remainder": remainder, **workers_cfg},
    )
    results = ranks(world, _train, cfg, size, 3, timeout=120)
    want = expected(size, world, micro, accum, 3, remainder)
    assert harness.order_of(results) == want
    plain = reference.plain_train(RECIPE, harness.data_for(RECIPE, size), want)
    harness.compare(results, plain, TOL)


def test_a_stream_trains_as_the_map_style_data_set_in_its_order(ranks):
    """A stream in index order and the same samples as a map-style data set under ``shuffle =
    False`` give the same batches, so the same run, bit for bit."""
    cfg = harness.config(
        {"strategy": "replicate"}, RECIPE, 8, 2, data={"shuffle": False, "remainder": "pad"}
    )
    stream = ranks(2, _train, cfg, 21, 2, True, None, timeout=120)
    mapped = ranks(2, _train, cfg, 21, 2, False, timeout=120)
    for a, b in zip(stream, mapped, strict=True):
        assert a["ids"] == b["ids"] and a["losses"] == b["losses"]
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def _train_and_save(cfg: dict, ckpt: str, steps: int, save_at: int, load: bool) -> dict:
    """Train on a stream to ``steps``, saving at ``save_at`` (or first resuming from the
    checkpoint): the sample ids of every step this run took, and the final weights."""
    model, opt, _ = RECIPE.build()
    engine = longboat.initialize(model, opt, cfg)
    if load:
        engine.load_checkpoint(ckpt)
    loader = engine.loader(Stream(harness.data_for(RECIPE, 20)))
    ids: list[list[int]] = []
    while engine.global_step < steps:
        for sample_ids, *batch in loader:
            engine.backward(reference.forward_loss(engine, batch))
            ids.append(sample_ids.tolist())
            if engine.step() and engine.global_step == save_at and not load:
                engine.save_checkpoint(ckpt)
            if engine.global_step == steps:
                break
    out = {"ids": ids, "state": {k: v.detach().clone() for k, v in engine.state_dict().items()}}
    engine.close()
    return out


def test_a_stream_resumes_mid_epoch_from_a_checkpoint(ranks, tmp_path):
    """Saved at step 3, in the second epoch of a stream (2 steps of 8 per epoch), and resumed:
    the rest of that epoch and the next, the samples and the weights of the run never stopped."""
    cfg = harness.config({"strategy": "replicate"}, RECIPE, 8, 2, data={"remainder": "drop"})
    whole = ranks(2, _train_and_save, cfg, str(tmp_path), 6, 3, False, timeout=120)
    resumed = ranks(2, _train_and_save, cfg, str(tmp_path), 6, 3, True, timeout=120)
    for w, r in zip(whole, resumed, strict=True):
        assert r["ids"] == w["ids"][3 * 2 :]  # 2 micro-batches per step
        assert all(torch.equal(w["state"][k], r["state"][k]) for k in w["state"])


# -- the script's own DataLoader -----------------------------------------------------------------


def _sampled(size: int, batch: int, num_replicas: int, rank: int | None, epochs: int) -> list:
    """This rank's batches of ``engine.loader(DataLoader(..., sampler=DistributedSampler))``
    over ``epochs`` epochs (``rank=None``: the sampler's rank is this process's)."""
    engine = _bare_engine(harness.config({}, RECIPE, 8, 2))
    me = torch.distributed.get_rank()
    data = TensorDataset(torch.arange(size))
    sampler = DistributedSampler(data, num_replicas, me if rank is None else rank, seed=5)
    try:
        loader = engine.loader(DataLoader(data, batch_size=batch, sampler=sampler))
        return [[b.tolist() for (b,) in loader] for _ in range(epochs)]
    finally:
        engine.close()


def test_a_dataloader_with_a_distributed_sampler_is_used_as_it_is(ranks):
    """Its batches are the sampler's, epoch by epoch (set_epoch called): not sharded again."""
    results = ranks(2, _sampled, 24, 2, 2, None, 2, timeout=120)
    data = TensorDataset(torch.arange(24))
    for r, res in enumerate(results):
        sampler = DistributedSampler(data, 2, r, seed=5)
        for e in range(2):
            sampler.set_epoch(e)
            order = list(sampler)
            assert res[e] == [order[i : i + 2] for i in range(0, len(order), 2)]
    for e in range(2):
        assert sorted(i for res in results for b in res[e] for i in b) == list(range(24))
    assert results[0][0] != results[0][1]


def test_a_sampler_that_disagrees_on_one_rank_is_refused_on_every_rank(ranks):
    """``rank=0`` on both ranks: only rank 1 disagrees, and both raise, naming it, the values
    and the fix (rank 0 alone going on would wait for rank 1 in its first collective)."""
    with pytest.raises(RankFailure) as info:
        ranks(2, _sampled, 24, 2, 2, 0, 1, timeout=120)
    failures = info.value.failures
    assert sorted(failures) == [0, 1], failures
    for text in failures.values():
        assert "ConfigError" in text and "rank(s) 1:" in text, text
        assert "num_replicas=2, rank=0" in text and "data-parallel rank 1 of 2" in text, text
        assert "DistributedSampler(dataset, num_replicas=2, rank=1)" in text, text


def test_dataloader_problems_name_the_value_and_the_fix():
    data = TensorDataset(torch.arange(24))

    def problem(loader: DataLoader, **kw) -> str | None:
        args = {"rank": 1, "world_size": 2, "batch_size": 4, "per_step": False}
        return dataloader_problem(loader, **{**args, "shuffle": None, "collate_fn": None, **kw})

    sampled = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 1))
    assert problem(sampled) is None
    plain = problem(DataLoader(data, batch_size=4, shuffle=True))
    assert plain and "RandomSampler, not a DistributedSampler" in plain
    assert "engine.loader(loader.dataset" in plain
    wide = problem(DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 4, 1)))
    assert wide and "num_replicas=4, rank=1" in wide and "mesh.dp = 2" in wide
    big = problem(DataLoader(data, batch_size=8, sampler=DistributedSampler(data, 2, 1)))
    assert big and "batch_size=8" in big and "batch.micro_batch_size = 4" in big
    assert "shuffle=True" in (problem(sampled, shuffle=True) or "")
    assert "collate_fn" in (problem(sampled, collate_fn=list) or "")
    both = refusal([None, "x", "x", "y"])
    assert both == "engine.loader cannot use this DataLoader:\n  rank(s) 1, 2: x\n  rank(s) 3: y"
    assert refusal([None, None]) is None


def test_a_dataloader_without_a_distributed_sampler_is_refused_by_the_engine():
    model, opt, _ = RECIPE.build()
    cfg = harness.config({}, RECIPE, 4, 4)
    with longboat.initialize(model, opt, cfg) as engine:
        with pytest.raises(ConfigError, match=r"SequentialSampler, not a DistributedSampler"):
            engine.loader(DataLoader(TensorDataset(torch.arange(8)), batch_size=4))
        with pytest.raises(TypeError, match=r"map-style data set .* IterableDataset"):
            engine.loader(iter(range(8)))  # type: ignore[arg-type]


def test_a_dataloader_resumes_mid_epoch():
    data = TensorDataset(torch.arange(24))

    def loader() -> UserLoader:
        sampled = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, 2, 1, seed=2))
        return UserLoader(sampled, 3)

    a = loader()
    epochs = [[b.tolist() for (b,) in a] for _ in range(2)]
    b = loader()
    list(b)
    it = iter(b)
    head = [next(it)[0].tolist() for _ in range(2)]
    c = loader()
    c.load_state_dict(b.state_dict())
    assert b.state_dict() == {"epoch": 1, "samples": 2 * 3 * 2}
    assert head + [x.tolist() for (x,) in c] == epochs[1]


# -- in one process ------------------------------------------------------------------------------


def _stream_loader(dataset: IterableDataset, world: int = 1, rank: int = 0, **kw) -> object:
    args = {"micro_batch_size": 2, "train_batch_size": 2 * world, "remainder": "drop"}
    return make_stream_loader(
        dataset,
        rank=rank,
        world_size=world,
        shuffle=None,
        seed=0,
        announce=False,
        **{**args, **kw},
    )


@pytest.mark.parametrize("remainder", ["drop", "pad", "join"])
@pytest.mark.parametrize(("world", "micro", "step"), [(1, 2, 6), (2, 2, 8), (4, 1, 12)])
def test_stream_batches_are_the_map_style_batches_without_shuffle(remainder, world, micro, step):
    """The same batches on every rank as the map-style loader of the same samples under
    ``shuffle = False``, for 3 to 41 samples (fewer than a step, a step, a step and some)."""
    for size in (3, step, 41):
        data = TensorDataset(torch.arange(size))
        for rank in range(world):
            kw = {"micro_batch_size": micro, "train_batch_size": step, "remainder": remainder}
            if remainder == "drop" and size < step:
                continue  # refused (the map-style loader at once, a stream when it ends)
            mapped = make_loader(
                data, rank=rank, world_size=world, shuffle=False, seed=0, announce=False, **kw
            )
            stream = _stream_loader(Stream(data, None), world, rank, **kw)
            assert [b[0].tolist() for b in stream] == [b[0].tolist() for b in mapped]


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_workers_build_the_batches_of_one_reader():
    """3 workers (more than the rank's micro-batches of a short last step) and 2 ranks: the
    batches, in order, of the same loader without workers, under each remainder."""
    data = TensorDataset(torch.arange(37))
    for remainder in ("drop", "pad", "join"):
        kw = {"micro_batch_size": 2, "train_batch_size": 8, "remainder": remainder}
        alone = [b[0].tolist() for b in _stream_loader(Stream(data), 2, 1, **kw)]
        loader = _stream_loader(Stream(data), 2, 1, num_workers=3, **kw)
        assert [b[0].tolist() for b in loader] == alone


def test_a_stream_that_splits_itself_among_workers_is_read_whole():
    """A stream that gives each worker process a part of itself (as ``datasets`` does) still
    has each sample read once: the workers are shown the whole of it."""
    loader = _stream_loader(SplitsItself(20), 2, 0, num_workers=2, remainder="join")
    assert [b.tolist() for b in loader] == [[0, 2], [4, 6], [8, 10], [12, 14], [16, 18]]


def test_a_stream_resumes_with_the_same_draws_in_workers_at_any_world_size():
    """Stopped two micro-batches into epoch 1 and resumed: with workers, the same samples and
    the same draws made while streaming; at another world size (the global batch kept), the
    same samples left over the ranks together."""
    kw = {"num_workers": 2, "persistent_workers": True}
    a = _stream_loader(Noisy(24), 2, 1, **kw)
    epochs = [[b.tolist() for b in a] for _ in range(2)]
    assert epochs[0] != epochs[1]  # the draws, not the samples
    assert [[x[0] for x in b] for b in epochs[0]] == [[x[0] for x in b] for b in epochs[1]]
    b = _stream_loader(Noisy(24), 2, 1, **kw)
    list(b)
    it = iter(b)
    head = [next(it).tolist() for _ in range(2)]
    c = _stream_loader(Noisy(24), 2, 1, **kw)
    c.load_state_dict(b.state_dict())
    assert head + [x.tolist() for x in c] == epochs[1]
    # at one rank with micro-batches of 4: the 16 samples the two ranks had left
    one = _stream_loader(Noisy(24), 1, 0, micro_batch_size=4, train_batch_size=4)
    one.load_state_dict(b.state_dict())
    assert sorted(int(x[0]) for batch in one for x in batch) == list(range(8, 24))


def test_set_epoch_is_called_before_each_epoch():
    stream = Stream(TensorDataset(torch.arange(8)))
    loader = _stream_loader(stream)
    firsts = [next(iter(loader))[0].tolist() for _ in range(3)]  # leaving each epoch early
    assert stream.epochs == [0, 0, 0]  # an epoch left early is not over
    for _ in loader:
        pass
    list(loader)
    assert stream.epochs == [0, 0, 0, 0, 1]
    assert firsts[0] == Stream.order(8, 0)[:2]


def test_what_a_stream_cannot_do_is_refused_by_name():
    loader = _stream_loader(Stream(TensorDataset(torch.arange(8))))
    with pytest.raises(TypeError, match=r"a stream .* has no length"):
        len(loader)
    with pytest.raises(ConfigError, match=r"shuffle=True.*shuffle it inside the stream"):
        make_stream_loader(
            Stream(TensorDataset(torch.arange(8))),
            rank=0,
            world_size=1,
            micro_batch_size=2,
            train_batch_size=2,
            shuffle=True,
            seed=0,
            remainder="drop",
        )
    short = _stream_loader(Stream(TensorDataset(torch.arange(5))), train_batch_size=8)
    with pytest.raises(ConfigError, match=r"5 samples in epoch 0, fewer than one step's 8"):
        list(short)
    once = iter([torch.tensor(i) for i in range(4)])

    class OneShot(IterableDataset):
        def __iter__(self):
            return once

    one_shot = _stream_loader(OneShot())
    assert len(list(one_shot)) == 2
    with pytest.raises(ConfigError, match="yielded no samples in epoch 1"):
        list(one_shot)


def test_the_training_process_generators_do_not_move_for_a_stream():
    """Without workers a stream that draws nothing leaves torch's and Python's generators
    where they were (the loader's worker seed comes from a generator of its own)."""
    torch.manual_seed(3)
    random.seed(3)
    before = (torch.get_rng_state(), random.getstate())
    list(_stream_loader(Stream(TensorDataset(torch.arange(8)))))
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
