"""Sharded loading: the union of rank shards is the single-process batch ([Note: shards] in
``data/sharded.py``)."""

import pytest
import torch
from torch.utils.data import TensorDataset

from longboat.data import ShardedSampler, make_loader


def _batches(n, world, micro, step, remainder="drop", epoch=0, seed=3):
    ds = TensorDataset(torch.arange(n))
    out = []
    for r in range(world):
        loader = make_loader(
            ds,
            rank=r,
            world_size=world,
            micro_batch_size=micro,
            train_batch_size=step,
            shuffle=True,
            seed=seed,
            remainder=remainder,
            announce=False,
        )
        loader.epoch = epoch
        out.append([b[0].tolist() for b in loader])
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_union_of_shards_is_the_single_process_batch(world):
    n, step = 100, 16
    single = _batches(n, 1, step, step)[0]
    shards = _batches(n, world, step // world, step)
    assert all(len(s) == len(single) == n // step for s in shards)
    for t, batch in enumerate(single):
        assert sorted(x for s in shards for x in s[t]) == sorted(batch)


def test_drop_and_pad():
    drop = ShardedSampler(10, 0, 2, 4, remainder="drop")
    pad = ShardedSampler(10, 1, 2, 4, remainder="pad")
    assert len(drop) == 4 and drop.leftover == 2
    assert len(pad) == 6
    everything = sorted(list(ShardedSampler(10, 0, 2, 4, remainder="pad")) + list(pad))
    assert set(everything) == set(range(10)) and len(everything) == 12


def test_join_keeps_the_last_step_where_it_falls():
    """remainder='join': the last step's samples are neither dropped nor padded; each rank keeps
    those that fall to it, so ranks may end with fewer (and partial) micro-batches."""
    shards = _batches(41, 2, 4, 16, remainder="join")
    assert [len(s) for s in shards] == [6, 5]  # 2 full steps of 2 micro-batches, then 5 and 4
    assert [len(b) for b in shards[0][4:]] == [4, 1] and [len(b) for b in shards[1][4:]] == [4]
    assert sorted(x for s in shards for b in s for x in b) == list(range(41))
    # Before the last step, the same samples as under 'drop', micro-batch by micro-batch.
    assert [s[:4] for s in shards] == _batches(41, 2, 4, 16, remainder="drop")
    assert [len(ShardedSampler(41, r, 2, 16, remainder="join")) for r in (0, 1)] == [21, 20]
    assert len(ShardedSampler(3, 3, 4, 16, remainder="join")) == 0  # fewer samples than ranks


def test_epochs_reshuffle_and_are_reproducible():
    s = ShardedSampler(50, 0, 2, 10, seed=1)
    s.set_epoch(0)
    a = list(s)
    s.set_epoch(1)
    b = list(s)
    s.set_epoch(0)
    assert list(s) == a and a != b


def test_loader_advances_epoch_by_itself():
    ds = TensorDataset(torch.arange(40))
    loader = make_loader(
        ds,
        rank=0,
        world_size=1,
        micro_batch_size=8,
        train_batch_size=8,
        shuffle=True,
        seed=0,
        remainder="drop",
        announce=False,
    )
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    assert first != second
    assert sorted(x for b in first for x in b) == sorted(x for b in second for x in b)


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one step"):
        ShardedSampler(5, 0, 2, 8, remainder="drop")


class _Noisy(torch.utils.data.Dataset):
    """Samples drawn with torch's RNG in the loading process: the worker seeds show."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), float(torch.rand(()))])


@pytest.mark.parametrize("workers", [(2, 3, True), (1, None, False)])
def test_worker_processes_load_what_a_resumed_loader_loads(workers):
    from longboat.config import load_config

    num_workers, prefetch, persistent = workers
    cfg = load_config(
        {
            "data": {
                "num_workers": num_workers,
                "prefetch_factor": prefetch,
                "persistent_workers": persistent,
            }
        }
    ).data

    def loader():
        return make_loader(
            _Noisy(),
            rank=1,
            world_size=2,
            micro_batch_size=3,
            train_batch_size=6,
            shuffle=True,
            seed=0,
            remainder="drop",
            announce=False,
            num_workers=cfg.num_workers,
            prefetch_factor=cfg.prefetch_factor,
            persistent_workers=cfg.persistent_workers,
        )

    a = loader()
    epochs = [[b.tolist() for b in a] for _ in range(2)]  # two epochs, workers kept or not
    assert epochs[0] != epochs[1] and len(epochs[0]) == 4
    # stop mid-epoch 1, resume in a new loader: the rest of that epoch, the same samples and
    # the same random draws of the workers
    b = loader()
    list(b)
    it = iter(b)
    head = [next(it).tolist() for _ in range(2)]
    c = loader()
    c.load_state_dict(b.state_dict())
    assert head + [x.tolist() for x in c] == epochs[1]


def test_worker_options_need_workers():
    from longboat.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"data\.prefetch_factor needs worker processes"):
        load_config({"data": {"prefetch_factor": 4}})


def test_worker_count_does_not_change_the_draws():
    def epoch(workers: int) -> list:
        loader = make_loader(
            _Noisy(),
            rank=0,
            world_size=1,
            micro_batch_size=4,
            train_batch_size=4,
            shuffle=True,
            seed=1,
            remainder="drop",
            announce=False,
            num_workers=workers,
        )
        return [b.tolist() for b in loader]

    assert epoch(1) == epoch(2)


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_a_regrouped_loader_deals_the_rest_of_the_epoch_over_the_new_ranks(remainder):
    """[Note: regrouped loader]: 3 ranks take 2 steps, then the live iterations of 2 of them
    are re-dealt from the failed step's start: the epoch's permutation is consumed in order,
    each sample once, and the epoch ends in whole steps of the new size."""
    n, micro = 29, 2
    ds = TensorDataset(torch.arange(n))

    def loader(r):
        return make_loader(
            ds,
            rank=r,
            world_size=3,
            micro_batch_size=micro,
            train_batch_size=micro * 3,
            shuffle=True,
            seed=5,
            remainder=remainder,
            announce=False,
        )

    whole = _batches(n, 1, n, n, remainder="join", seed=5)[0][0]  # the epoch's permutation
    loaders = [loader(r) for r in range(3)]
    its = [iter(lo) for lo in loaders]
    seen = [[next(it)[0].tolist() for _ in range(3)] for it in its]  # the third step fails
    assert [lo.where() for lo in loaders] == [(0, 18)] * 3  # handed out, not completed
    for new, old in enumerate((0, 2)):
        loaders[old].regroup(new, 2, 0, 12)
    rest = [[b[0].tolist() for b in its[old]] for old in (0, 2)]
    assert [lo.epoch for lo in (loaders[0], loaders[2])] == [1, 1]
    dealt = [x for step in zip(*rest, strict=True) for batch in step for x in batch]
    flat = [x for s in range(2) for r in range(3) for x in seen[r][s]]
    order = whole + whole[: 4 - (n - 12) % 4] if remainder == "pad" else whole
    steps = (n - 12) // 4 + (remainder == "pad")
    assert sorted(flat) == sorted(order[:12])
    # each step's samples on the new ranks: positions 12 + 4t + r + 2i
    assert rest == [
        [[order[12 + 4 * t + r + 2 * i] for i in range(micro)] for t in range(steps)]
        for r in range(2)
    ]
    assert len(dealt) == 4 * steps


def test_a_replacements_loader_starts_where_the_others_stand_and_the_next_epoch_grows():
    """[Note: regrouped loader]: a loader placed before its first iteration (a replacement's)
    deals from the others' position at the new size; regrouped at an epoch's very end, a live
    loader finishes that epoch and deals the next over the new ranks."""
    n, micro = 24, 2
    ds = TensorDataset(torch.arange(n))

    def loader(r, world):
        return make_loader(
            ds,
            rank=r,
            world_size=world,
            micro_batch_size=micro,
            train_batch_size=micro * world,
            shuffle=False,
            seed=5,
            remainder="drop",
            announce=False,
        )

    joiner = loader(2, 3)
    joiner.place(0, 8)  # two steps of 2 ranks were taken
    assert joiner.where() == (0, 8)
    # positions 8 + 2 + 3i, then the next step's from 14: whole steps of 6 from sample 8
    assert [b[0].tolist() for b in joiner] == [[10, 13], [16, 19]]
    live = loader(1, 2)
    it = iter(live)
    assert [next(it)[0].tolist() for _ in range(6)][-1] == [21, 23]  # the epoch's last step
    assert live.where() == (1, 0)
    live.regroup(1, 3, *live.where())
    assert next(it, None) is None and live.epoch == 1  # the old epoch ends as it was
    assert next(iter(live))[0].tolist() == [1, 4]  # the next one over 3 ranks
