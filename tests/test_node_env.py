"""`longboat run` as one node of a Slurm or PyTorchJob job: the node flags read from the
environment (pure functions), and the CLI under faked scheduler environments (subprocesses)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from longboat.cli.run import _node_flags
from longboat.launch.node_env import (
    NodeDefaults,
    NodeEnvError,
    TasksPerNodeError,
    detect,
    first_host,
    slurm_master_port,
)

SCRIPTS = Path(__file__).parent / "launch_scripts"
TIMEOUT_S = 120
RESULT = re.compile(
    r"^\[rank(\d+)\]: RESULT rank=(\d+) local_rank=(\d+) world_size=(\d+) sum=(\S+)"
)

# Under srun --ntasks-per-node=1 on the third of four nodes (as Slurm sets it, less the noise).
SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "2",
    "SLURM_NODEID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "4",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_NODES": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "gpu[003-005,9]",
    "SLURM_JOB_NODELIST": "gpu[001,003-005,9]",
    "SLURM_NODELIST": "gpu[001,003-005,9]",
}
# A PyTorchJob pod (training-operator >= 1.7) of Master + 3 Workers, nprocPerNode 8: Worker 1.
PYTORCHJOB = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "PET_NNODES": "4",
    "PET_NODE_RANK": "2",
    "PET_NPROC_PER_NODE": "8",
    "PET_MASTER_ADDR": "job-master-0",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "RANK": "2",
    "WORLD_SIZE": "32",  # pods x nprocPerNode: the worker count, not the node count
}


def test_srun_one_task_per_node() -> None:
    assert detect(SRUN) == NodeDefaults(
        nnodes=4,
        node_rank=2,
        master_addr="gpu003",  # the step's first node, not the job's (gpu001)
        master_port=15000 + 4242,
        source="Slurm (SLURM_STEP_NUM_NODES, SLURM_NODEID, SLURM_STEP_NODELIST, SLURM_JOB_ID)",
    )


def test_srun_without_step_variables_reads_the_job_ones() -> None:
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP_") or k == "SLURM_STEP_ID"}
    found = detect(env)
    assert found is not None
    assert (found.nnodes, found.node_rank, found.master_addr) == (4, 2, "gpu001")
    assert found.source == "Slurm (SLURM_NNODES, SLURM_NODEID, SLURM_NODELIST, SLURM_JOB_ID)"


def test_master_variables_set_by_the_user_win_under_srun() -> None:
    found = detect({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert found is not None
    assert (found.master_addr, found.master_port) == ("10.0.0.1", 29500)
    assert found.source.endswith("MASTER_ADDR, MASTER_PORT)")


def test_world_and_launcher_derive_the_same_slurm_port() -> None:
    from longboat.world import World
    from longboat.world import first_host as world_first_host

    worker_env = {**SRUN, "SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_NTASKS_PER_NODE": "4"}
    assert World.from_env(worker_env).master_port == slurm_master_port(SRUN) == 15000 + 4242
    assert World.from_env(worker_env).master_addr == "gpu003"
    assert world_first_host is first_host  # still importable from longboat.world


def test_one_node_job_keeps_the_local_defaults() -> None:
    env = {**SRUN, "SLURM_NNODES": "1", "SLURM_NTASKS": "1", "SLURM_NODEID": "0"}
    env.update(SLURM_STEP_NUM_NODES="1", SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")
    assert detect(env) == NodeDefaults(
        1, 0, "127.0.0.1", None, "Slurm (SLURM_STEP_NUM_NODES, SLURM_NODEID)"
    )


def test_several_tasks_per_node_under_srun_is_refused() -> None:
    env = {**SRUN, "SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16", "SLURM_PROCID": "9"}
    with pytest.raises(TasksPerNodeError) as e:
        detect(env)
    message = str(e.value)
    assert message.startswith("srun started 16 tasks on 4 node(s)")
    assert "`srun --ntasks-per-node=1 longboat run -n K ...`" in message
    assert "run the script directly under srun" in message


def test_sbatch_script_outside_srun_is_not_a_launch() -> None:
    # A batch script has the job's variables and SLURM_PROCID=0, but no step.
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    assert detect({**env, "SLURM_PROCID": "0", "SLURM_NODEID": "0"}) is None


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "HOSTNAME": "web-1"},  # a pod, not a job's
        # What a worker that torchrun or longboat run started sees, under srun or in a pod.
        {**SRUN, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"},
        {**PYTORCHJOB, "LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "none"},
    ],
    ids=["nothing", "plain-pod", "torchrun-worker-under-srun", "torchrun-worker-in-pytorchjob"],
)
def test_nothing_detected(env: dict[str, str]) -> None:
    assert detect(env) is None


def test_pytorchjob_prefers_pet_variables() -> None:
    assert detect(PYTORCHJOB) == NodeDefaults(
        nnodes=4,  # PET_NNODES, not WORLD_SIZE=32
        node_rank=2,
        master_addr="job-master-0",
        master_port=23456,
        source="Kubernetes (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT)",
    )
    # Where both are set, PET_* win.
    found = detect({**PYTORCHJOB, "PET_MASTER_ADDR": "10.1.2.3", "RANK": "0"})
    assert found is not None and (found.master_addr, found.node_rank) == ("10.1.2.3", 2)


def test_pytorchjob_before_pet_variables() -> None:
    # training-operator < 1.7: RANK is the pod's rank and WORLD_SIZE the number of pods.
    env = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "RANK": "1",
        "WORLD_SIZE": "3",
    }
    assert detect(env) == NodeDefaults(
        3, 1, "job-master-0", 23456, "Kubernetes (WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT)"
    )


def test_trainjob_sets_only_pet_variables() -> None:
    env = {k: v for k, v in PYTORCHJOB.items() if k.startswith(("PET_", "KUBERNETES_"))}
    found = detect(env)
    assert found is not None and (found.nnodes, found.node_rank) == (4, 2)


@pytest.mark.parametrize(("nnodes", "expected"), [("4:4", 4), ("2", 2)])
def test_pet_nnodes_fixed_range_is_a_count(nnodes: str, expected: int) -> None:
    found = detect({**PYTORCHJOB, "PET_NNODES": nnodes, "PET_NODE_RANK": "1"})
    assert found is not None and found.nnodes == expected


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({**SRUN, "SLURM_STEP_NUM_NODES": "four"}, "SLURM_STEP_NUM_NODES='four' is not an integer"),
        (
            {**SRUN, "SLURM_NODEID": "4"},
            "SLURM_NODEID='4' is out of range for SLURM_STEP_NUM_NODES",
        ),
        ({**SRUN, "SLURM_JOB_ID": "12.3"}, "SLURM_JOB_ID='12.3' is not an integer"),
        ({**SRUN, "MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a TCP port"),
        (
            {**PYTORCHJOB, "PET_NODE_RANK": "-1"},
            "PET_NODE_RANK='-1' is out of range for PET_NNODES",
        ),
        ({**PYTORCHJOB, "PET_NNODES": "x"}, "PET_NNODES='x' is not an integer"),
        ({**PYTORCHJOB, "PET_NNODES": "1:3"}, "PET_NNODES='1:3' is a range of node counts"),
        ({**PYTORCHJOB, "PET_MASTER_PORT": "port"}, "PET_MASTER_PORT='port' is not an integer"),
    ],
)
def test_bad_values_are_named(env: dict[str, str], named: str) -> None:
    with pytest.raises(NodeEnvError, match=re.escape(named)):
        detect(env)


def test_elastic_pytorchjob_without_master_replica_is_refused() -> None:
    # elasticPolicy and Workers only: the operator gives the rendezvous endpoint, no node rank.
    env = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "PET_NNODES": "3",
        "PET_RDZV_ENDPOINT": "job-worker-0:23456",
        "PET_RDZV_BACKEND": "c10d",
    }
    with pytest.raises(NodeEnvError) as e:
        detect(env)
    assert "no PET_NODE_RANK or RANK, PET_MASTER_ADDR or MASTER_ADDR, PET_MASTER_PORT" in str(
        e.value
    )
    assert "add a Master replica, or pass --nnodes, --node-rank" in str(e.value)


def test_node_env_does_not_import_torch() -> None:
    code = "import sys, longboat.launch.node_env; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the CLI's use of it ---------------------------------------------------------------------


def test_given_flags_win_and_the_rest_are_filled(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "environ", dict(SRUN))
    assert _node_flags(None, 3, None, 29500) == (4, 3, "gpu003", 29500)
    assert capsys.readouterr().err == (
        "longboat: node 3 of 4 from Slurm (SLURM_STEP_NUM_NODES, SLURM_NODEID, "
        "SLURM_STEP_NODELIST, SLURM_JOB_ID); master gpu003:29500; --node-rank, --master-port "
        "as given\n"
    )


def test_all_flags_given_or_standalone_read_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # An environment detect() refuses: neither call may look at it.
    monkeypatch.setattr(os, "environ", {**SRUN, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8"})
    assert _node_flags(2, 1, "10.0.0.1", 29500) == (2, 1, "10.0.0.1", 29500)
    assert _node_flags(None, None, None, None, detect=False) == (1, 0, "127.0.0.1", None)
    assert capsys.readouterr().err == ""


def _env(**scheduler: str) -> dict[str, str]:
    """This process's environment without any scheduler's variables, plus ``scheduler``'s."""
    ours = ("SLURM_", "PET_", "KUBERNETES_", "TORCHELASTIC_")
    theirs = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours) and k not in theirs}
    return {**env, **scheduler}


def _start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "longboat.cli", "run", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Wait for every process; kill each one's process group if time runs out."""
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return results


def _one_node_srun(ntasks: int) -> dict[str, str]:
    return _env(
        SLURM_JOB_ID="77",
        SLURM_STEP_ID="0",
        SLURM_PROCID="0",
        SLURM_NODEID="0",
        SLURM_NNODES="1",
        SLURM_NTASKS=str(ntasks),
        SLURM_STEP_NODELIST="127.0.0.1",
    )


def test_cli_under_a_one_node_srun() -> None:
    script = str(SCRIPTS / "torchrun_allreduce.py")
    ((code, out, err),) = _finish([_start(_one_node_srun(1), "-n", "2", script)])
    assert code == 0, err
    assert (
        "longboat: node 0 of 1 from Slurm (SLURM_NNODES, SLURM_NODEID); master 127.0.0.1 "
        "(a free port)"
    ) in err.splitlines()
    results = [m for line in out.splitlines() if (m := RESULT.match(line))]
    assert sorted((int(m[2]), int(m[4]), float(m[5])) for m in results) == [(0, 2, 3), (1, 2, 3)]


def test_cli_refuses_several_tasks_per_node() -> None:
    script = str(SCRIPTS / "torchrun_allreduce.py")
    ((code, out, err),) = _finish([_start(_one_node_srun(4), "-n", "2", script)])
    assert code == 2, (out, err)
    assert err.startswith("longboat: error: srun started 4 tasks on 1 node(s)"), err
    assert "use `srun --ntasks-per-node=1 longboat run -n K ...`" in err
    assert "RESULT" not in out


def _two_node_envs(kind: str, port: int) -> list[dict[str, str]]:
    if kind == "slurm":
        common = {
            "SLURM_JOB_ID": "78",
            "SLURM_STEP_ID": "0",
            "SLURM_NNODES": "2",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_NODELIST": "node[1-2]",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        return [_env(**common, SLURM_NODEID=str(n), SLURM_PROCID=str(n)) for n in (0, 1)]
    common = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "PET_NNODES": "2",
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": "4",
    }
    return [_env(**common, PET_NODE_RANK=str(n), RANK=str(n)) for n in (0, 1)]


@pytest.mark.parametrize("kind", ["slurm", "pytorchjob"])
def test_cli_as_two_nodes_of_a_job(kind: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = str(SCRIPTS / "torchrun_allreduce.py")
    envs = _two_node_envs(kind, port)
    # Node 1 first: it must wait for node 0 rather than fail.
    results = _finish([_start(envs[1], "-n", "2", script), _start(envs[0], "-n", "2", script)])
    for node, (code, out, err) in zip((1, 0), results, strict=True):
        assert code == 0, err
        assert f"longboat: node {node} of 2 from " in err and f"master 127.0.0.1:{port}" in err
        ranks = [m for line in out.splitlines() if (m := RESULT.match(line))]
        # Global ranks 2 node .. 2 node + 1, all four ranks in the all-reduce: 1+2+3+4.
        assert sorted((int(m[2]), int(m[4]), float(m[5])) for m in ranks) == [
            (2 * node, 4, 10),
            (2 * node + 1, 4, 10),
        ], out
