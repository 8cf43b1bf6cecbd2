"""World detection from each launcher's environment."""

import os

import pytest

from longboat.world import World, first_host


def test_single_process():
    w = World.from_env({})
    assert (w.rank, w.world_size, w.local_rank, w.node_rank) == (0, 1, 0, 0)
    assert not w.distributed and w.is_main


def test_torchrun():
    w = World.from_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
        }
    )
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank) == (5, 8, 1, 4, 1)
    assert (w.master_addr, w.master_port) == ("10.0.0.1", 1234)


def test_slurm():
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "gpu[017-018]",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
    }
    w = World.from_env(env)
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank) == (6, 8, 2, 4, 1)
    assert w.master_addr == "gpu017"
    assert w.master_port == 15000 + 4242
    assert World.from_env({**env, "MASTER_PORT": "999"}).master_port == 999


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node1", "node1"),
        ("gpu[003-005,9],cpu1", "gpu003"),
        ("a[7,9]", "a7"),
        ("host-01,host-02", "host-01"),
    ],
)
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


def test_openmpi():
    w = World.from_env(
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "h0",
        }
    )
    assert (w.rank, w.world_size, w.local_rank, w.node_rank, w.master_addr) == (3, 4, 1, 1, "h0")


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        World.from_env({"RANK": "0", "WORLD_SIZE": "two"})
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        World.from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_ranks_started_without_a_launcher_listen_only_on_the_master_address():
    """Under srun/mpirun (no agent store), rank 0 serves the job's store itself: on
    MASTER_ADDR:MASTER_PORT, not on every interface as torch's env:// store does."""
    import subprocess
    import sys
    from pathlib import Path

    from longboat.network import bind_listener

    with bind_listener("127.0.0.1", 0) as s:
        port = s.getsockname()[1]
    script = Path(__file__).parent / "launch_scripts" / "listeners_by_hand.py"
    procs = []
    for rank in range(2):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TORCHELASTIC_", "RANK", "WORLD_SIZE", "SLURM_"))
        }
        env.update(
            SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_STEP_ID="0", SLURM_NNODES="1",
            SLURM_LOCALID=str(rank), SLURM_NODEID="0", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("SUM 3" in out for out in outs)
    listening = [line.split()[1] for line in outs[0].splitlines() if line.startswith("LISTEN")]
    assert f"127.0.0.1:{port}" in listening, listening
    wild = [a for a in listening if a.startswith(("0.0.0.0:", ":::", "::"))]
    assert not wild, listening


def test_leaving_the_group_ends_its_threads_after_an_optimizer_was_built():
    """A gloo group joined by longboat and left with ``destroy_process_group`` takes its worker
    threads with it, even after the script built an optimizer (which imports torch's compiler):
    threads left running into interpreter shutdown abort a finished rank now and then ([Note:
    dynamo before the group] in world.py)."""
    import re
    from pathlib import Path

    import harness

    script = Path(__file__).parent / "launch_scripts" / "teardown_threads.py"
    res = harness.longboat_run("-n", "2", str(script))
    assert res.returncode == 0, res.stdout
    found = re.findall(r"SUM (\S+) RUNNING (\d+) GLOO_THREADS (\d+)", res.stdout)
    assert len(found) == 2, res.stdout
    for total, running, left in found:
        assert total == "2" and int(running) > 0  # the count sees gloo's threads while they run
        assert left == "0", res.stdout
