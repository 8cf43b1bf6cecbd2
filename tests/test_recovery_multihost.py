"""In-job recovery across machines (docs/recovery.md): hosts simulated by network namespaces
(tests/netns_hosts.py), one ``longboat run --hostfile`` launcher per host, a rank on the second
host SIGKILLed after step 2. The survivors on both hosts regroup without it and finish, each
step equal to the plain PyTorch loop with the world shrinking (tests/recovery_checks.py), with
no restart and no checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import recovery_checks
from netns_hosts import netns_hosts, unavailable

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "launch_scripts" / "train_in_job.py"
STEPS = 5

needs_netns = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@needs_netns
@pytest.mark.parametrize(("slots", "victim"), [((2, 2), 3), ((2, 1), 2)])
def test_a_rank_lost_on_another_host_is_regrouped_without(tmp_path, slots, victim):
    # (2, 2), rank 3: rank 2 shares the lost rank's host and its launcher's record of the
    # death. (2, 1), rank 2: the lost rank was alone on its host, so no survivor shares that
    # launcher's records; its launcher publishes the death in the job's store ([Note: deaths
    # across nodes] in recovery/membership.py), else the survivors' agreement waited for the
    # lost rank until recovery.wait_s (10 s in the script; measured 10.0 s).
    world, kill_after = sum(slots), 2
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    with netns_hosts(len(slots)) as hosts:
        hostfile = tmp_path / "hostfile"
        hostfile.write_text(
            "".join(f"{h} slots={n}\n" for h, n in zip(hosts.names, slots, strict=True))
        )
        argv = [sys.executable, "-m", "longboat.cli", "run", "--hostfile", str(hostfile)]
        argv += ["--remote-shell", "netns", str(SCRIPT), str(out), str(STEPS)]
        argv += ["--kill-rank", str(victim), "--kill-after", str(kill_after)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
        left = [n for n in hosts.names if hosts.pids(n)]
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert not left, left  # nothing still running on any host
    assert f"rank {victim} (replica {victim}) was killed by SIGKILL" in log, log[-6000:]
    assert "restarting all workers" not in log, log[-6000:]
    survivors = [r for r in range(world) if r != victim]
    said = re.findall(r"in-job recovery: lost rank\(s\) (\d+) .* generation (\d+)", log)
    assert said == [(str(victim), "1")] * len(survivors), log[-6000:]
    # A deadline, not a timing: the window the agreement closes at without news of the death.
    agreed = [float(a) for a in re.findall(r"\(agree ([\d.]+) s", log)]
    assert len(agreed) == len(survivors) and max(agreed) < 10, log[-6000:]
    recovery_checks.assert_matches_shrinking_plain_loop(
        out, world, survivors, kill_after, STEPS, "tiny"
    )
