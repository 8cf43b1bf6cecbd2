"""What an in-job recovery run of tests/launch_scripts/train_in_job.py must have done: every
step's samples and loss on every survivor, then the final state, against the plain PyTorch loop
of tests/reference.py with the world shrinking after the kill (tests/test_recovery_in_job.py
and tests/test_recovery_multihost.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import harness
import reference
import torch
from safetensors.torch import load_file

TOL = 1e-5  # fp32, relative
MICRO = 2


def expected_order(world: int, lost: int, kill_after: int, steps: int) -> list:
    """[step][micro-batch][rank] -> sample ids, as [Note: shards] deals them, the world
    shrinking by ``lost`` ranks after step ``kill_after``."""
    order, start = [], 0
    for step in range(steps):
        n = world if step < kill_after else world - lost
        order.append([[[start + r + i * n for i in range(MICRO)] for r in range(n)]])
        start += MICRO * n
    return order


def assert_matches_shrinking_plain_loop(
    out: Path, world: int, survivors: Sequence[int], kill_after: int, steps: int, model: str
) -> None:
    """Each survivor's records (``OUT/rank<r>.json``) and saved state (``.safetensors``): every
    sample of every step once, on the rank the shrinking world gives it, each loss and the
    final state within ``TOL`` of the plain loop, and the survivors equal to each other."""
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"rank{r}.{ext}" for r in survivors for ext in ("json", "safetensors")
    )
    order = expected_order(world, world - len(survivors), kill_after, steps)
    data = reference.dataset if model == "tiny" else reference.image_dataset
    plain = reference.plain_train(
        reference.Recipe(model, "adamw"), reference.indexed(data(60)), order
    )
    states = {}
    for r in survivors:
        records = json.loads((out / f"rank{r}.json").read_text())
        assert [rec["step"] for rec in records] == list(range(1, steps + 1))
        for rec in records:
            s, rank = rec["step"] - 1, rec["rank"]
            assert rec["ids"] == order[s][0][rank], (r, rec)
            want = plain.losses[s][0][rank]
            assert abs(rec["loss"] - want) <= TOL * max(abs(want), 1.0), (r, rec, want)
        states[r] = load_file(out / f"rank{r}.safetensors")
    first, *others = survivors
    for r in others:  # the replicas stayed replicas
        assert states[r].keys() == states[first].keys()
        assert all(torch.equal(states[r][k], states[first][k]) for k in states[first]), r
    harness.assert_saved_state_matches_plain(states[first], plain, TOL)
