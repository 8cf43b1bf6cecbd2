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
