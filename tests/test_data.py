"""Sharded loading: the union of rank shards is the single-process batch (see data.py's note)."""

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
