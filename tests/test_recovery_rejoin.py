"""In-job recovery with replacements (docs/recovery.md): a rank of a `replicate` job is
SIGKILLed under `longboat run --max-restarts N`; the survivors regroup without it and redo the
failed step, the launcher starts a replacement, and the survivors take it in at a step
boundary, rank 0 sending it the state: no checkpoint exists or is read.

The comparison is the plain PyTorch loop of tests/reference.py over the same global sample order,
with the world each step had. Which step a replacement entered is not guessed: every rank
records each step's world size, the replacement records the steps it trained, and the test
checks that these agree (the replacement's first step is the first one at the grown size).
Losses, parameters, buffers and AdamW state are compared within 1e-5 relative, as every fp32
equivalence test (the loop sums gradients in one process, the ranks average them by
all-reduce); every rank, replacements included, must hold exactly the same state at the end.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path

import harness
import pytest
import recovery_checks
import reference
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).parent / "launch_scripts" / "train_in_job.py"
TOL = 1e-5  # fp32, relative
MICRO = 2
STEPS = 24
SAMPLES = 200  # STEPS steps of at most 4 ranks x MICRO: one epoch, no wrap


def _run(
    tmp_path: Path, world: int, kills: list[tuple[int, int]], *extra: str, restarts: int = 0
) -> tuple[str, Path]:
    out = tmp_path / "out"
    args = [f"--kill={r}:{k}" for r, k in kills]
    proc = harness.longboat_run(
        "-n",
        str(world),
        "--max-restarts",
        str(restarts or len(kills)),
        str(SCRIPT),
        str(out),
        str(STEPS),
        "--kill-rank",
        "-1",
        *args,
        "--wait-joiner",
        "--samples",
        str(SAMPLES),
        *extra,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout
    return proc.stdout, out


def _check(
    log: str, out: Path, world: int, kills: list[tuple[int, int]], left: Sequence[int] = ()
) -> list[int]:
    """Every rank's records and final state against the plain loop (``left``: ranks that left
    their replica, replaced too); returns each step's world size, as the ranks recorded it."""
    killed = [r for r, _ in kills]
    for r in killed:
        assert f"longboat: rank {r} (replica {r}) was killed by SIGKILL; a replacement" in log
    for r in left:
        assert (
            f"longboat: rank {r} (replica {r}) left its replica, which had lost a rank; a " in log
        )
    victims = [*killed, *left]
    assert "restarting all workers" not in log, log  # the launcher restarted no one
    joined = re.findall(r"replacement \(id \d+\) taken in as rank", log)
    assert len(joined) == len(victims), log
    assert "no checkpoint read" in log
    # Nothing but the ranks' own records was written: no checkpoint exists to be read.
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("started.")) == sorted(
        f"rank{r}.{ext}" for r in range(world) for ext in ("json", "safetensors")
    )
    records = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}
    sizes: dict[int, int] = {}
    for recs in records.values():
        for rec in recs:
            assert sizes.setdefault(rec["step"], rec["world"]) == rec["world"], rec
    assert sorted(sizes) == list(range(1, STEPS + 1))
    worlds = [sizes[s] for s in range(1, STEPS + 1)]
    for r in victims:  # a replacement trained from the step it entered to the end
        steps = [rec["step"] for rec in records[r]]
        assert steps == list(range(steps[0], STEPS + 1)), steps
        assert worlds[steps[0] - 2] < worlds[steps[0] - 1], (r, steps[0], worlds)
    order, start = [], 0
    for n in worlds:
        order.append([[[start + r + i * n for i in range(MICRO)] for r in range(n)]])
        start += MICRO * n
    plain = reference.plain_train(
        reference.Recipe("tiny", "adamw"), reference.indexed(reference.dataset(SAMPLES)), order
    )
    for r, recs in records.items():
        for rec in recs:
            s = rec["step"] - 1
            assert rec["ids"] == order[s][0][rec["rank"]], (r, rec)
            want = plain.losses[s][0][rec["rank"]]
            assert abs(rec["loss"] - want) <= TOL * max(abs(want), 1.0), (r, rec, want)
    states = {r: load_file(out / f"rank{r}.safetensors") for r in range(world)}
    if left:  # ZeRO: each rank's pieces, the same at the same place of every replica
        whole = recovery_checks.assemble_pieces(states.values())
        states = {
            r: {**whole, **{k: v for k, v in st.items() if k.startswith("model.")}}
            for r, st in states.items()
        }
    for r in range(1, world):  # replicas again, replacements included: bit for bit
        assert states[r].keys() == states[0].keys()
        assert all(torch.equal(states[r][k], states[0][k]) for k in states[0]), r
    harness.assert_saved_state_matches_plain(states[0], plain, TOL)
    return worlds


def test_a_replacement_joins_from_a_live_peer_and_the_world_is_whole_again(tmp_path):
    log, out = _run(tmp_path, 3, [(1, 2)])
    worlds = _check(log, out, 3, [(1, 2)])
    # 3 ranks until the kill after step 2; step 3 redone at 2; back to 3 until the end
    back = worlds.index(3, 2)
    assert worlds == [3, 3] + [2] * (back - 2) + [3] * (STEPS - back), worlds


def test_two_losses_the_second_before_the_first_replacement_is_in(tmp_path):
    kills = [(1, 2), (3, 3)]
    log, out = _run(tmp_path, 4, kills)
    worlds = _check(log, out, 4, kills)
    assert worlds[:3] == [4, 4, 3] and worlds[3] == 2, worlds  # two losses, a step apart
    assert worlds[-1] == 4
    grown = [b for a, b in itertools.pairwise(worlds[3:]) if b != a]
    assert grown == [3, 4], worlds  # one replacement taken in per boundary


# Hybrid sharding, ZeRO-2 and -3 over 2 replicas x 2 shards: rank 3 lost takes its replica with it;
# rank 2 leaves it and is replaced as rank 3 is. The two replacements build their engines
# together as one shard group, each at its launch rank's place, and are taken in together,
# each sent the state of the rank at its place in the replica that went on.
@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_takes_a_whole_replica_back_in(tmp_path, stage):
    kills = [(3, 2)]
    log, out = _run(tmp_path, 4, kills, "--zero-stage", str(stage), restarts=2)
    worlds = _check(log, out, 4, kills, left=[2])
    back = worlds.index(4, 2)
    assert worlds == [4, 4] + [2] * (back - 2) + [4] * (STEPS - back), worlds
