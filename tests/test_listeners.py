"""Every socket the tools open listens on loopback, never on the wildcard nor on the LAN:
``longboat bench``, ``longboat tune``, ``longboat doctor``, ``longboat run -n 2`` and the test
pool's ranks are sampled while they run, and any listener off loopback fails the test. torch's
stores have no authentication, so such a listener is open to the network for as long as it
lives ([Note: listeners] in longboat/network.py).

gloo's pairs listen on the address the hostname resolves to unless told otherwise; here the
hostname resolves to 127.0.0.1, which would hide that. Where ``unshare`` can give a command a
hostname of its own, each command runs under a hostname that is one of this machine's LAN
addresses, so a rank left to gloo's default shows up on it."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from functools import cache
from pathlib import Path

import psutil
import pytest

from longboat.network import interfaces

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
Listener = tuple[int, str, int]  # pid, address, port


def _listeners(pids: list[int]) -> set[Listener]:
    """The TCP listeners these processes hold now (processes gone meanwhile are skipped)."""
    found: set[Listener] = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        found |= {(pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return found


def _tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


@cache
def _lan_hostname() -> list[str]:
    """A command prefix that runs it under a hostname resolving to a LAN address of this
    machine (a UTS namespace of its own), or [] where that cannot be done."""
    lan = [
        a
        for addrs in interfaces().values()
        for a in addrs
        if ":" not in a and not ipaddress.ip_address(a).is_loopback
    ]
    unshare = shutil.which("unshare")
    if not lan or unshare is None:
        return []
    prefix = [unshare, "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', lan[0]]
    probe = subprocess.run([*prefix, "hostname"], capture_output=True, text=True)
    return prefix if probe.returncode == 0 and probe.stdout.strip() == lan[0] else []


def _sampled(
    cmd: list[str], ready: str | None = None
) -> tuple[subprocess.CompletedProcess[str], set[Listener]]:
    """Run ``cmd`` (under the LAN hostname) and collect its process tree's listeners every
    20 ms until it ends. With ``ready``, sample once more when the command prints that line,
    then close its stdin (the pool's script waits for that)."""
    proc = subprocess.Popen(
        [*_lan_hostname(), *cmd],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    seen: set[Listener] = set()
    output: list[str] = []

    def read() -> None:
        assert proc.stdout is not None and proc.stdin is not None
        for line in proc.stdout:
            output.append(line)
            if ready is not None and line.strip() == ready:
                seen.update(_listeners(_tree(proc.pid)))
                proc.stdin.close()

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(_listeners(_tree(proc.pid)))
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join()
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(output)), seen


def _longboat(*args: str) -> tuple[subprocess.CompletedProcess[str], set[Listener]]:
    return _sampled([sys.executable, "-m", "longboat.cli", *args])


def _check(res: subprocess.CompletedProcess[str], seen: set[Listener]) -> None:
    assert res.returncode == 0, res.stdout
    # The ranks' stores and gloo's pairs were seen: an empty sample would prove nothing.
    assert len({pid for pid, _, _ in seen}) >= 2, (seen, res.stdout)
    off = sorted(x for x in seen if not ipaddress.ip_address(x[1]).is_loopback)
    assert not off, f"listeners off loopback (pid, address, port): {off}"


def test_bench_listens_on_loopback_only(tmp_path: Path) -> None:
    _check(
        *_longboat(
            "bench", "--out", str(tmp_path), "--model", "tiny-gpt", "--strategies",
            "replicate", "--peers", "", "--world-sizes", "2", "--micro-batch", "2",
            "--seq-len", "8", "--warmup", "1", "--steps", "1", "--threads", "1",
        )
    )  # fmt: skip


def test_tune_listens_on_loopback_only(tmp_path: Path) -> None:
    # The link measurement's ranks and one measured candidate's.
    _check(
        *_longboat(
            "tune", "--model", "tiny-gpt", "--seq-len", "8", "--world-size", "2",
            "--global-batch", "4", "--micro-batches", "2", "--bucket-mb", "25",
            "--no-recompute", "--top", "1", "--warmup", "1", "--steps", "1", "--time", "5m",
            "--out", str(tmp_path / "tuned.toml"),
        )
    )  # fmt: skip


def test_doctor_listens_on_loopback_only() -> None:
    _check(*_longboat("doctor", "-n", "2"))


def test_run_listens_on_loopback_only(tmp_path: Path) -> None:
    """A torchrun-style script: the agent's store, the workers' gloo pairs."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            import torch
            import torch.distributed as dist
            dist.init_process_group("gloo")
            dist.all_reduce(torch.ones(1))
            time.sleep(0.5)  # the pairs stay up a few samples long
            dist.destroy_process_group()
            """
        )
    )
    _check(*_longboat("run", "-n", "2", str(script)))


def test_pool_ranks_listen_on_loopback_only() -> None:
    script = textwrap.dedent(
        """
        import os, sys
        from longboat.testing import RankPool
        pool = RankPool(2, timeout=60)
        pool.run(os.getpid)  # the group is up: rank 0's store serves
        print("ready", flush=True)
        sys.stdin.read()
        pool.close()
        """
    )
    res, seen = _sampled([sys.executable, "-c", script], ready="ready")
    _check(res, seen)


def test_a_busy_port_is_an_error_not_a_wildcard_store() -> None:
    """The tools' stores never fall back to torch's own listener: a port taken meanwhile is
    refused (the job's own store may fall back, where MASTER_ADDR is not this host's)."""
    import datetime
    import socket

    from longboat.world import bound_store

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(OSError):
            bound_store("127.0.0.1", port, 0, 2, datetime.timedelta(seconds=5))


# ------------------------------------------------------------ --no-ssh: the port of node 0


def _hostfile(tmp_path: Path, hosts: list[str]) -> Path:
    f = tmp_path / "hostfile"
    f.write_text("".join(f"{h} slots=1\n" for h in hosts))
    return f


def test_no_ssh_over_several_hosts_asks_for_the_port(tmp_path: Path) -> None:
    """Every host runs the command on its own: none can choose a free port for the others, and
    a fixed default would let a second job's nodes join the first job's rendezvous."""
    script = tmp_path / "train.py"
    script.write_text("print('started')\n")
    hostfile = _hostfile(tmp_path, ["h0", "h1"])
    res = subprocess.run(
        [sys.executable, "-m", "longboat.cli", "run", "--hostfile", str(hostfile), "--no-ssh",
         "--node-rank", "1", str(script)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "--no-ssh with 2 hosts needs --master-port" in res.stderr, res.stderr
    assert "node 0 (h0) listens on it" in res.stderr
    assert "started" not in res.stdout


def test_no_ssh_on_one_host_takes_a_free_port(tmp_path: Path) -> None:
    """With the default port taken by another job, a one-host --no-ssh run still starts."""
    import socket

    script = tmp_path / "train.py"
    script.write_text("import os\nprint('PORT', os.environ['MASTER_PORT'])\n")
    hostfile = _hostfile(tmp_path, ["127.0.0.1"])
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen(1)
        except OSError:
            pass  # in use already: taken either way
        res = subprocess.run(
            [sys.executable, "-m", "longboat.cli", "run", "--hostfile", str(hostfile),
             "--no-ssh", "--node-rank", "0", str(script)],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    ports = {line.split()[-1] for line in res.stdout.splitlines() if "PORT" in line}
    assert len(ports) == 1 and "29500" not in ports, res.stdout
