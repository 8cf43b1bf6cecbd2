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
    if any(k.startswith("piece.") for k in states[first]):  # ZeRO: each rank's pieces
        whole = assemble_pieces(states.values())
        states = {
            r: {**whole, **{k: v for k, v in st.items() if k.startswith("model.")}}
            for r, st in states.items()
        }
    for r in others:  # the replicas stayed replicas
        assert states[r].keys() == states[first].keys()
        assert all(torch.equal(states[r][k], states[first][k]) for k in states[first]), r
    harness.assert_saved_state_matches_plain(states[first], plain, TOL)


def assemble_pieces(states) -> dict[str, torch.Tensor]:
    """The optimizer state put together from each rank's ``piece.<name>.<key>.<start>.<end>``,
    ``shape.<name>.<key>`` and ``scalar.<name>.<key>`` (tests/launch_scripts/train_in_job.py
    with --zero-stage) as ``optim.<name>.<key>``: every element held by some rank, ranks that
    hold the same element (replicas) equal."""
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for st in states:
        for k, v in st.items():
            if k.startswith("shape."):
                key = k.removeprefix("shape.")
                if key not in full:
                    full[key] = torch.full((int(v.prod()),), float("nan"))
                    seen[key] = torch.zeros(int(v.prod()), dtype=torch.bool)
        for k, v in st.items():
            if k.startswith("piece."):
                key, start, end = k.removeprefix("piece.").rsplit(".", 2)
                a, b = int(start), int(end)
                held = seen[key][a:b]
                assert torch.equal(full[key][a:b][held], v.to(full[key].dtype)[held]), key
                full[key][a:b] = v
                seen[key][a:b] = True
    shapes = {
        k.removeprefix("shape."): v
        for st in states
        for k, v in st.items()
        if k.startswith("shape.")
    }
    out = {}
    for key, t in full.items():
        assert bool(seen[key].all()), f"no rank holds all of {key}"
        out[f"optim.{key}"] = t.view(*[int(d) for d in shapes[key]])
    for st in states:
        for k, v in st.items():
            if k.startswith("scalar."):
                out[f"optim.{k.removeprefix('scalar.')}"] = v
    return out
