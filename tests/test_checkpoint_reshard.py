"""Resharding: a checkpoint saved by one strategy at one world size, loaded by another strategy
at another world size, then trained on, equals a run that never changed layout (fp32: 1e-5
relative), optimizer state and LR schedule included. Saved at 2 ranks and loaded at 1, 3 and 4;
saved at 1, 3 and 4 and loaded at 2; across replicate and ZeRO stages 1, 2 and 3."""

from __future__ import annotations

import ckpt_helpers as h
import pytest
import reference

SAVE_AT, STEPS = 3, 7
STRATEGIES = ["replicate", "zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """The run that never changed layout: one process, the same global batch and seed (itself
    checked against the plain loop below)."""
    return h.run("single", 1, STEPS, save_at=(SAVE_AT,), noise=False)


def test_the_uninterrupted_run_equals_plain_pytorch(uninterrupted):
    recipe = reference.Recipe(model="tiny", optimizer="adamw", scheduler=True)
    order = [[[ids] for ids in step] for step in uninterrupted["trained"]["ids"]]
    plain = reference.plain_train(
        recipe, reference.indexed(reference.dataset(h.GLOBAL_BATCH * h.EPOCH)), order
    )
    assert reference.max_rel_diff(uninterrupted["state"], plain.state) < 1e-5
    assert uninterrupted["lr"] == [plain.lrs[-1]]


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """Checkpoints at step SAVE_AT, written once per (strategy, world size)."""
    cache: dict[tuple[str, int], str] = {}

    def get(layout: str, world: int) -> str:
        if (layout, world) not in cache:
            d = str(tmp_path_factory.mktemp(f"{layout}-{world}"))
            ranks(world, h.run, layout, world, SAVE_AT, d, (SAVE_AT,), noise=False)
            cache[(layout, world)] = d
        return cache[(layout, world)]

    return get


def _resume_everywhere(
    ranks, ckpt: str, worlds: list[int], uninterrupted: dict, layouts: list[str] = STRATEGIES
) -> None:
    failures = []
    for world in worlds:
        for layout in layouts:
            results = ranks(world, h.run, layout, world, STEPS, ckpt, (), True, noise=False)
            for r, res in enumerate(results):
                # The load restored step SAVE_AT's weights (not what a fresh run starts with).
                assert res["loaded_step"] == SAVE_AT, (layout, world, res["loaded_step"])
                at_save = uninterrupted["trained"]["saved"][SAVE_AT]
                assert reference.max_rel_diff(res["loaded"], at_save) < 1e-5, (layout, world)
                assert reference.max_rel_diff(res["fresh"], at_save) > 1e-3, (layout, world)
                diff = reference.max_rel_diff(res["state"], uninterrupted["state"])
                if diff >= 1e-5 or res["lr"] != uninterrupted["lr"]:
                    failures.append(
                        f"{layout} x {world} rank {r}: max relative difference "
                        f"{diff:.3g}, lr {res['lr']}"
                    )
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("source", STRATEGIES)
def test_save_at_2_load_at_1_3_4(ranks, saved, uninterrupted, source):
    _resume_everywhere(ranks, saved(source, 2), [1, 3, 4], uninterrupted)


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("source", STRATEGIES)
def test_save_at_1_3_4_load_at_2(ranks, saved, uninterrupted, source, world):
    _resume_everywhere(ranks, saved(source, world), [2], uninterrupted)


def test_tied_weights_reshard_across_zero3_units(ranks, tmp_path):
    """TiedNet shares a weight between two modules (two stage-3 units): stored once, under its
    first name, and loaded into every layout."""
    ckpt = str(tmp_path)
    tied = {"model_name": "tied", "noise": False}
    whole = h.run("single", 1, STEPS, **tied)
    zero3 = {"stage": 3, "unit_classes": ["Linear"]}  # proj and head: two units, one weight
    ranks(4, h.run, "zero3", 4, SAVE_AT, ckpt, (SAVE_AT,), zero=zero3, **tied)
    for world, layout in [(2, "replicate"), (3, "zero1"), (1, "single")]:
        for res in ranks(world, h.run, layout, world, STEPS, ckpt, (), True, **tied):
            assert reference.max_rel_diff(res["state"], whole["state"]) < 1e-5, (layout, world)


def test_hybrid_sharding_reshards_both_ways(ranks, saved, uninterrupted):
    """A 2 x 2 hybrid-sharded checkpoint (ZeRO-3 within pairs, replicas across them: each shard
    written once, by one replica) loads into every other layout, and theirs into it."""
    _resume_everywhere(ranks, saved("hsdp", 4), [1, 3], uninterrupted)
    _resume_everywhere(ranks, saved("hsdp", 4), [2], uninterrupted, ["replicate", "zero3"])
    for source in ("replicate", "zero2"):
        _resume_everywhere(ranks, saved(source, 2), [4], uninterrupted, ["hsdp"])
