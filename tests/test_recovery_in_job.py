"""In-job recovery of replicated state (docs/recovery.md): a rank of a `replicate` job is
SIGKILLed after step K under `longboat run`; the survivors regroup without it, redo step K + 1
on the new ranks and finish, with no restart and no checkpoint.

The comparison is the plain PyTorch loop of tests/reference.py over the same global sample
order with the world shrinking at step K + 1: rank r of n takes the step's positions r, r + n,
... (samples in their stored order), at n ranks before the kill and n - 1 after. Within 1e-5
relative, as every equivalence test of fp32: the loop sums each rank's gradient in one process,
the ranks average theirs by all-reduce, so the last bits differ. (A longboat run started at 2
ranks from step K's state would match bit for bit, but only by trusting longboat's own
checkpoint path, which this feature exists to avoid.) The survivors equal each other exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import harness
import pytest
import recovery_checks
import reference

import longboat
from longboat.config.errors import ConfigError
from longboat.config.loading import load_config

SCRIPT = Path(__file__).parent / "launch_scripts" / "train_in_job.py"
STEPS = 5


# Rank 0 of 4 lost: every survivor is renumbered, and the rank that broadcast the initial
# weights and opened the monitors is gone; the survivors notice in the optimizer step's wait.
# In gloo's ring, rank 2 is no neighbour of rank 0: no connection of its own fails, and it
# must learn of the loss through the store ([Note: watched waits] in comm/watched.py), not at
# comm.timeout_s (60 s here: past recovery.wait_s, 10 s, the others would have gone on
# without it). The ResNet's BatchNorm buffers are broadcast after each backward: rank 1 lost
# is noticed there, and the rest of the interrupted step must not leak into the redone one.
@pytest.mark.parametrize(
    ("world", "victim", "model", "far"), [(4, 0, "tiny", 2), (3, 1, "resnet", None)]
)
def test_survivors_regroup_and_match_the_shrinking_plain_loop(tmp_path, world, victim, model, far):
    kill_after = 2
    out = tmp_path / "out"
    timeout_s = 60 if far is not None else 10
    proc = harness.longboat_run(
        "-n",
        str(world),
        str(SCRIPT),
        str(out),
        str(STEPS),
        "--kill-rank",
        str(victim),
        "--kill-after",
        str(kill_after),
        "--model",
        model,
        "--timeout-s",
        str(timeout_s),
        timeout=150,
    )
    log = proc.stdout
    assert proc.returncode == 0, log
    if far is not None:  # the far survivor gave up its collective on word from the store
        assert re.search(
            rf"\[rank{far}\]: .* in-job recovery: a collective of group '\S+' abandoned after "
            r"[\d.]+ s: .* \(learned from the store",
            log,
        ), log
        # and its work, still pending in the old group, did not hold its regroup until that
        # group's timeout (measured: 59.4 s of 60 when it did). A deadline, not a timing:
        # recovery.wait_s (10 s), the longest the others wait for a member.
        regroup = re.search(rf"\[rank{far}\]: .* lost rank.* regroup ([\d.]+) s\)", log)
        assert regroup and float(regroup[1]) < 10, log
    assert f"longboat: rank {victim} (replica {victim}) was killed by SIGKILL" in log, log
    assert "restarting all workers" not in log, log  # the launcher restarted no one
    survivors = [r for r in range(world) if r != victim]
    said = re.findall(r"in-job recovery: lost rank\(s\) (\d+) .* generation (\d+)", log)
    assert said == [(str(victim), "1")] * len(survivors), log
    recovery_checks.assert_matches_shrinking_plain_loop(
        out, world, survivors, kill_after, STEPS, model
    )


def _initialize_in_job(strategy: str) -> str:
    """On a pool rank (no launcher agent serves the store): what initialize says."""
    model, optimizer, _ = reference.Recipe("tiny", "adamw").build()
    cfg = {"strategy": strategy, "batch": {"micro_batch_size": 2}, "recovery": {"in_job": True}}
    try:
        engine = longboat.initialize(model, optimizer, cfg)
    except ConfigError as e:
        return str(e)
    engine.close()
    return "accepted"


def test_without_a_launcher_serving_the_store_in_job_recovery_is_refused(ranks):
    said = ranks(2, _initialize_in_job, "replicate")
    assert all(
        "needs the store to outlive any rank: start the job with longboat run" in s for s in said
    ), said


def test_sharded_state_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="only copy of its shard"):
        load_config({"strategy": "zero", "recovery": {"in_job": True}})


# Hybrid sharding, two replicas each sharded over two ranks ([Note: membership]): the replica
# that lost a rank leaves whole, its survivor saying why (no --max-restarts: dropped); the other
# replica goes on alone, its ranks renumbered 0 and 1 and keeping their shards. Rank 1 lost:
# the replica that goes on is the second one (launch ranks 2 and 3, renumbered), so a shard
# kept at a new rank is checked; rank 3 lost under stage 3: the leaving survivor's next
# forward gathers from the lost rank. "after-vote": rank 3 dies in step 3 as it starts
# averaging its shards with the other replica, the step's usage vote over every rank over:
# rank 0's average (with rank 2) completes, rank 1's (with rank 3) fails, and rank 0 must not
# step its shard before it knows ([Note: whole steps of a shard group]; without that barrier
# rank 0's shard stepped twice and this case failed). "before-vote": the vote still in
# flight, never to complete, under comm.timeout_s = 60: the regroup must not wait for it (when
# the survivors let go of their old groups at once, the regroup waited out comm.timeout_s in
# 4 runs of 8 at 10, 20, 30 and 60 s: 9.4 and 29.7 s; the others were spared by the leaving
# rank's exit failing the vote first).
@pytest.mark.parametrize(
    ("victim", "stage", "where"),
    [(1, 2, None), (3, 3, None), (2, 1, None), (3, 2, "after-vote"), (3, 2, "before-vote")],
)
def test_hybrid_sharding_goes_on_with_the_whole_replicas(tmp_path, victim, stage, where):
    kill_after, world = 2, 4
    out = tmp_path / "out"
    proc = harness.longboat_run(
        "-n",
        str(world),
        str(SCRIPT),
        str(out),
        str(STEPS),
        "--kill-rank",
        str(victim),
        "--kill-after",
        str(kill_after),
        "--zero-stage",
        str(stage),
        *(["--in-average", where, "--timeout-s", "60"] if where else []),
        timeout=150,
    )
    log = proc.stdout
    assert proc.returncode == 0, log
    assert "restarting all workers" not in log, log
    block = [0, 1] if victim < 2 else [2, 3]
    (partner,) = [r for r in block if r != victim]
    survivors = [r for r in range(world) if r not in block]
    assert re.search(
        rf"in-job recovery: rank {partner} \(id at launch\) leaves: the 2 ranks holding its "
        rf"replica together \(ids \[{block[0]}, {block[1]}\]\) lost {victim}",
        log,
    ), log
    said = re.findall(r"in-job recovery: lost rank\(s\) ([\d, ]+) .* generation (\d+)", log)
    assert said == [(f"{block[0]}, {block[1]}", "1")] * len(survivors), log
    # A deadline, not a timing: recovery.wait_s (10 s), the longest the others wait for a member.
    regroups = [float(t) for t in re.findall(r"lost rank.* regroup ([\d.]+) s\)", log)]
    assert len(regroups) == len(survivors) and max(regroups) < 10, log
    recovery_checks.assert_matches_shrinking_plain_loop(
        out, world, survivors, kill_after, STEPS, "tiny"
    )
