"""`longboat run` and `longboat config explain`, driven as a user would: the CLI in a subprocess.

Each launch costs a few seconds (the launcher and every worker import torch), so one launch
serves several assertions where it can.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import types
from collections.abc import Sequence
from pathlib import Path

import pytest

from longboat.launch.failures import WorkerExit, summarize
from longboat.launch.run import LaunchUsageError, RunOptions, validate

SCRIPTS = Path(__file__).parent / "launch_scripts"
TIMEOUT_S = 120
RESULT = re.compile(
    r"^\[rank(\d+)\]: RESULT rank=(\d+) local_rank=(\d+) world_size=(\d+) sum=(\S+) "
    r"omp=(\S+) args=(.*)$"
)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "longboat.cli", *args]


def _run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """Run the CLI with a hard timeout; on timeout, kill its whole process group."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"launcher timed out after {TIMEOUT_S}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (dead, not yet reaped by init) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_nothing_left(pid_dir: Path) -> None:
    pids = {p.name: int(p.read_text()) for p in pid_dir.iterdir()}
    # Both workers and the child each of them started (which would be orphaned if left).
    assert set(pids) == {"worker0", "worker1", "child0", "child1"}, pids
    left = {name: pid for name, pid in pids.items() if _alive(pid)}
    for pid in left.values():  # do not leak them into the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running after the launcher returned: {left}"


@pytest.fixture(scope="module")
def allreduce_run() -> subprocess.CompletedProcess[str]:
    """One -n 2 launch of a script written for torchrun, shared by several tests."""
    script = SCRIPTS / "torchrun_allreduce.py"
    return _run(_cli("run", "-n", "2", str(script), "--tag", "x", "-v"))


def test_torchrun_script_runs_unchanged(allreduce_run: subprocess.CompletedProcess[str]) -> None:
    assert allreduce_run.returncode == 0, allreduce_run.stderr
    results = [m for line in allreduce_run.stdout.splitlines() if (m := RESULT.match(line))]
    assert sorted(int(m[2]) for m in results) == [0, 1], allreduce_run.stdout
    for m in results:
        prefix_rank, rank, local_rank, world_size, total, omp, args = m.groups()
        assert prefix_rank == rank == local_rank
        assert int(world_size) == 2
        assert float(total) == 1 + 2  # all_reduce of rank + 1 over ranks 0 and 1
        assert omp == "1"  # set for the workers since the test did not set it
        assert args == "['--tag', 'x', '-v']"  # script arguments pass through, dashes too


def test_every_worker_line_has_one_rank_prefix(
    allreduce_run: subprocess.CompletedProcess[str],
) -> None:
    worker_out = allreduce_run.stdout.splitlines()
    assert worker_out and all(re.match(r"^\[rank[01]\]: ", line) for line in worker_out)
    worker_err = [line for line in allreduce_run.stderr.splitlines() if "STDERR" in line]
    assert sorted(worker_err) == ["[rank0]: STDERR rank=0", "[rank1]: STDERR rank=1"]


def test_local_ranks_filter_and_no_rank_prefix_as_torchrun_users_expect() -> None:
    script = str(SCRIPTS / "torchrun_allreduce.py")
    run = _run(
        _cli("run", "-n", "2", "--standalone", "--local-ranks-filter", "1", "--no-rank-prefix",
             script)
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    # rank 1's lines only, as the script printed them
    assert [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT")] == [
        "RESULT rank=1 local_rank=1 world_size=2 sum=3 omp=1 args=[]"
    ], run.stdout
    assert "[rank" not in run.stdout and "STDERR rank=1" in run.stderr
    assert "STDERR rank=0" not in run.stderr


@pytest.mark.parametrize(
    ("mode", "named", "code"),
    [
        ("raise", "longboat: rank 1 failed with exit code 1 (see its traceback above)", 1),
        ("kill", "longboat: rank 1 was killed by SIGKILL", 128 + signal.SIGKILL),
    ],
)
def test_failed_rank_is_named_and_nothing_is_left(
    tmp_path: Path, mode: str, named: str, code: int
) -> None:
    result = _run(_cli("run", "-n", "2", str(SCRIPTS / "fail.py"), str(tmp_path), mode))
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert named in lines, result.stderr
    # The culprit comes first; rank 0 (stuck in a barrier) is reported only as a follower.
    ours = [line for line in lines if line.startswith("longboat:")]
    assert ours[0] == named, ours
    assert not any("rank 0 failed" in line or "rank 0 was killed" in line for line in ours)
    if mode == "raise":
        traceback_line = lines.index("[rank1]: ValueError: rank 1 fails on purpose")
        assert traceback_line < lines.index(named)
    assert "[rank1]: [rank1]:" not in result.stderr  # torch's own prefix is not doubled
    # torch elastic only stops workers still running: the child of the dead rank 1 is ours.
    assert "the workers left behind" in result.stderr
    _assert_nothing_left(tmp_path)


@pytest.mark.parametrize("one_stays", [False, True])
def test_a_rank_that_lost_its_peer_says_so_before_the_launcher_stops_the_rest(
    one_stays: bool,
) -> None:
    # [Note: last words]: rank 0 speaks 0.4 s after its barrier failed, after the agent's next
    # 0.1 s tick; without the moment it is given, SIGTERM comes first and its line is lost.
    # At three ranks, rank 2 sleeps on.
    result = _run(_cli("run", "-n", "3" if one_stays else "2", str(SCRIPTS / "last_words.py")))
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("longboat:")]
    assert lines[0] == "longboat: rank 1 failed with exit code 1 (see its traceback above)"
    assert "[rank0]: rank 0 lost its peer: " in result.stderr, result.stderr
    assert "longboat: rank 0 then failed after losing a peer" in lines, lines
    # A rank that never ends by itself is still stopped, once the moment is over.
    stopped = [line for line in lines if "stopped by the launcher" in line]
    assert stopped == (["longboat: rank 2 stopped by the launcher (SIGTERM)"] if one_stays else [])


class _Proc:
    """A worker process as the agent's handler holds it: ends with ``code`` at ``poll`` number
    ``ends_at`` (None: never)."""

    def __init__(self, pid: int, code: int, ends_at: int | None) -> None:
        self.pid, self.code, self.ends_at, self.polls = pid, code, ends_at, 0

    def poll(self) -> int | None:
        self.polls += 1
        return self.code if self.ends_at is not None and self.polls >= self.ends_at else None


def _agent(*procs: _Proc) -> object:
    handlers = {i: types.SimpleNamespace(proc=p) for i, p in enumerate(procs)}
    return types.SimpleNamespace(_pcontext=types.SimpleNamespace(subprocess_handlers=handlers))


def test_last_words_waits_for_the_others_only_after_a_failure_and_keeps_the_first() -> None:
    from longboat.launch.last_words import Ended, LastWords

    words = LastWords(timeout_s=30)
    # Nothing failed: no wait, nothing kept.
    assert not words.settle(_agent(_Proc(10, 0, 1), _Proc(11, 0, None)))
    assert words.first_failure() is None
    # Rank 1 died; rank 0 ends at its third look, rank 2 had ended with 0 already.
    lost, dead = _Proc(10, 1, 3), _Proc(11, -9, 1)
    assert words.settle(_agent(lost, dead, _Proc(12, 0, 1)))
    assert lost.poll() == 1  # it was waited for, not stopped
    assert words.first_failure() == Ended(local_rank=1, pid=11, exitcode=-9)
    assert words.first_failure() is None  # each attempt its own
    # A rank that never ends costs the moment, and no more.
    quick = LastWords(timeout_s=0.05)
    assert quick.settle(_agent(_Proc(10, 1, 1), _Proc(11, 0, None)))
    assert quick.first_failure() == Ended(local_rank=0, pid=10, exitcode=1)


def test_restart_after_a_killed_rank() -> None:
    script = SCRIPTS / "restart.py"
    result = _run(_cli("run", "-n", "2", "--max-restarts", "1", str(script)))
    assert result.returncode == 0, result.stderr
    assert "longboat: rank 1 was killed by SIGKILL" in result.stderr
    assert "longboat: restarting all workers (attempt 2 of 2)" in result.stderr
    assert sorted(re.findall(r"RESULT attempt=1 rank=(\d) sum=2", result.stdout)) == ["0", "1"]


def test_two_nodes_on_one_machine() -> None:
    port = str(_free_port())
    script = str(SCRIPTS / "torchrun_allreduce.py")

    def node(rank: int) -> subprocess.Popen[str]:
        args = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        return subprocess.Popen(
            _cli("run", *args, "--master-port", port, "-n", "1", script),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    # Node 1 first: it must wait for node 0 rather than fail.
    nodes = [node(1), node(0)]
    outputs = []
    try:
        for proc in nodes:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    for (code, out, err), global_rank in zip(outputs, (1, 0), strict=True):
        assert code == 0, err
        (m,) = [m for line in out.splitlines() if (m := RESULT.match(line))]
        assert (int(m[1]), int(m[2]), int(m[3])) == (global_rank, global_rank, 0)
        assert int(m[4]) == 2 and float(m[5]) == 3


def test_a_node_that_never_joins_is_named_by_both_sides() -> None:
    """Two nodes that never meet: node 0 (of 3) says which nodes never came; a node whose
    master is not listening says where it dialled from and what it tried to reach."""
    script = str(SCRIPTS / "torchrun_allreduce.py")

    def node(port: int, rank: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            _cli("run", "--nnodes", "3", "--node-rank", str(rank), "--master-port", str(port),
                 "--rdzv-timeout", "3", script),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip

    port0, nowhere = _free_port(), _free_port()
    nodes = [node(port0, 0), node(port0, 1), node(nowhere, 2)]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in nodes]
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [p.returncode for p in nodes] == [1, 1, 1]
    never = (
        f"longboat: node 2 never joined the rendezvous at 127.0.0.1:{port0} within 3 s; "
        "joined: node 0 from 127.0.0.1, node 1 from 127.0.0.1"
    )
    closed = (
        f"longboat: node 1: node 0's rendezvous at 127.0.0.1:{port0} closed while waiting for "
        "node 2"
    )
    assert never in outs[0][1], outs[0][1]
    assert never in outs[1][1] or closed in outs[1][1], outs[1][1]  # whoever's deadline came first
    assert (
        f"longboat: node 2 could not reach node 0's rendezvous at 127.0.0.1:{nowhere} within "
        "3 s (dialled from 127.0.0.1)"
    ) in outs[2][1], outs[2][1]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["run", "no_such_script.py"], "script 'no_such_script.py' does not exist"),
        (["run", "-n", "0", "{script}"], "-n/--nproc-per-node '0': a node needs at least one"),
        (["run", "-n", "3:2", "{script}"], "-n/--nproc-per-node '3:2': MIN 3 is above MAX 2"),
        (["run", "-n", "1:2", "{script}"], "-n 1:2 restarts with fewer workers after a failure"),
        (["run", "--master-port", "70000", "{script}"], "--master-port 70000 is not a TCP port"),
        (["run", "--master-port", "{busy_port}", "{script}"], "is already in use"),
        (["run", "-n", "two", "{script}"], "-n/--nproc-per-node 'two' is not understood"),
        (["run", "--local-ranks-filter", "2", "{script}"], "--local-ranks-filter '2'"),
        (["run", "--local-ranks-filter", "a", "{script}"], "--local-ranks-filter 'a' is invalid"),
        (["run", "--standalone", "--nnodes", "2", "{script}"], "--standalone with --nnodes 2"),
        (["run", "--nnodes", "1:2", "{script}"], "--nnodes 1:2: a range of nodes"),
        (["run", "--nnodes", "x", "{script}"], "--nnodes 'x' is not a number of nodes"),
        (["config", "explain", "no_such.toml", "--world-size", "2"], "'no_such.toml'"),
        (["config", "explain", "{bad_config}", "--world-size", "2"], "'batch.micro_batch_size'"),
    ],
)
def test_usage_errors_exit_2_naming_the_flag(tmp_path: Path, args: list[str], named: str) -> None:
    script = str(SCRIPTS / "torchrun_allreduce.py")
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text("[batch]\nmicro_batch_size = -3\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        values = {
            "script": script,
            "busy_port": str(busy.getsockname()[1]),
            "bad_config": str(bad_config),
        }
        result = _run(_cli(*(a.format(**values) for a in args)))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert named in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"nnodes": 0}, "--nnodes 0 is invalid"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "--node-rank 2 is out of range"),
        ({"node_rank": -1}, "--node-rank -1 is out of range"),
        ({"nnodes": 2}, "--master-port is required with --nnodes 2"),
        ({"master_port": 0}, "--master-port 0 is not a TCP port"),
        ({"max_restarts": -1}, "--max-restarts -1 is invalid"),
        ({"rdzv_timeout_s": 0}, "--rdzv-timeout 0 is invalid"),
        ({"master_addr": " "}, "--master-addr is empty"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(
    changes: dict[str, object], named: str
) -> None:
    opts = RunOptions(script=SCRIPTS / "torchrun_allreduce.py", **changes)  # type: ignore[arg-type]
    with pytest.raises(LaunchUsageError, match=re.escape(named)):
        validate(opts)


def test_summary_prefers_the_culprit_over_ranks_that_lost_it() -> None:
    # Seen in the same monitor tick (same whole-second timestamp): torch would name rank 0.
    lost = "RuntimeError: [..pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    report = summarize(
        [
            WorkerExit(rank=0, pid=10, exitcode=1, timestamp=5, stderr_tail=lost),
            WorkerExit(rank=1, pid=11, exitcode=1, timestamp=5, stderr_tail="ValueError: x"),
            WorkerExit(rank=2, pid=12, exitcode=-signal.SIGTERM, timestamp=5),
        ]
    )
    assert report.root.rank == 1 and report.exit_code == 1
    assert report.lines == (
        "longboat: rank 1 failed with exit code 1 (see its traceback above)",
        "longboat: rank 0 then failed after losing a peer",
        "longboat: rank 2 stopped by the launcher (SIGTERM)",
    )
    # Only victims here (the culprit was on another node): say so.
    remote = summarize([WorkerExit(rank=0, pid=10, exitcode=1, stderr_tail=lost)])
    assert "it may run on another node" in remote.lines[1]
    killed = summarize([WorkerExit(rank=3, pid=13, exitcode=-signal.SIGSEGV)])
    assert killed.lines == ("longboat: rank 3 was killed by SIGSEGV",)
    assert killed.exit_code == 128 + signal.SIGSEGV


def _elastic_ids(tmp_path: Path, *flags: str) -> tuple[str, str]:
    script = tmp_path / "ids.py"
    script.write_text(
        "import os\nprint('IDS', os.environ['TORCHELASTIC_RUN_ID'], os.environ['ROLE_NAME'])\n"
    )
    res = _run(_cli("run", "-n", "1", *flags, str(script)))
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if "IDS " in ln)
    run_id, role = line.split("IDS ", 1)[1].split()
    return run_id, role


def test_run_id_is_fresh_per_run_and_role_is_default_as_torchrun_sets_them(
    tmp_path: Path,
) -> None:
    # torchrun --standalone: a fresh uuid per run; its --role default is "default"
    first, role = _elastic_ids(tmp_path)
    second, _ = _elastic_ids(tmp_path)
    assert first != second and role == "default"
    # torchrun's --rdzv-id: the user's id is used as given
    assert _elastic_ids(tmp_path, "--rdzv-id", "job-42") == ("job-42", "default")


def test_nodes_share_a_run_id() -> None:
    from longboat.launch.run import run_id

    opts = RunOptions(script=Path("x.py"), nnodes=2)
    # every node computes it alone: torchrun's default across nodes, the same on each
    assert run_id(opts) == run_id(opts) == "none"
    assert run_id(RunOptions(script=Path("x.py"), nnodes=2, rdzv_id="j")) == "j"
