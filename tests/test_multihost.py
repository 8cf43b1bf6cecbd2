"""Many machines: host lists, the environment forwarded, interface discovery, and whole jobs run
across network-namespace hosts (see tests/netns_hosts.py) through ``--hostfile`` and per node.

The namespace tests need root and ``ip``; CI runs as root. Every namespace is removed afterwards.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from netns_hosts import (
    DECOY_ADDR,
    SSH_PORT,
    NetnsHosts,
    netns_hosts,
    sshd_on,
    sshd_unavailable,
    unavailable,
)

from longboat.launch.discovery import DiscoveryError, _choose
from longboat.launch.forward_env import EnvFileError, forwarded
from longboat.launch.hosts import Host, HostsError, parse_host_list, parse_hostfile, select
from longboat.launch.shells import command_line, make

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "launch_scripts"
ALLREDUCE = SCRIPTS / "allreduce_then_wait.py"
DIGITS = REPO / "examples" / "digits.py"
TIMEOUT_S = 180

needs_netns = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


# ---------------------------------------------------------------- host lists (no processes)


def test_hostfile_reads_deepspeed_and_horovod_files(tmp_path: Path) -> None:
    f = tmp_path / "hostfile"
    f.write_text("# the cluster\nworker-0 slots=4\n\nworker-1   slots = 2  # half\nworker-2\n")
    assert parse_hostfile(f) == [
        Host("worker-0", (0, 1, 2, 3)),
        Host("worker-1", (0, 1)),
        Host("worker-2", (0,)),
    ]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("a slots=2\nb slots=1\na slots=2\n", "listed twice (first on line 1)"),
        ("a slots=two\n", "slots='two'"),
        ("a slots=0\n", "slots='0'"),
        ("a gpus=2\n", "is not `host slots=N`"),
        ("# nothing\n", "lists no host"),
    ],
)
def test_bad_hostfiles_are_refused_naming_the_line(tmp_path: Path, text: str, named: str) -> None:
    f = tmp_path / "hostfile"
    f.write_text(text)
    with pytest.raises(HostsError, match=re.escape(named)):
        parse_hostfile(f)


def test_dash_h_is_horovods_host_list() -> None:
    assert parse_host_list("n1:2,n2") == [Host("n1", (0, 1)), Host("n2", (0,))]
    with pytest.raises(HostsError, match="listed twice"):
        parse_host_list("n1:2,n1:2")


def test_include_and_exclude_mean_what_they_mean_in_deepspeed() -> None:
    hosts = [Host("a", (0, 1, 2, 3)), Host("b", (0, 1, 2, 3)), Host("c", (0, 1))]
    assert select(hosts, include="a@c:1") == [Host("a", (0, 1, 2, 3)), Host("c", (1,))]
    assert select(hosts, exclude="b@a:0,1") == [Host("a", (2, 3)), Host("c", (0, 1))]
    assert select(hosts, exclude="c:0,1") == hosts[:2]  # a host left with no slot is dropped
    assert not select(hosts, include="c:1")[0].all_slots  # -> CUDA_VISIBLE_DEVICES=1 there
    with pytest.raises(HostsError, match="host 'd' is not in the host list"):
        select(hosts, include="d")
    with pytest.raises(HostsError, match=re.escape("has slots 0..1, not")):
        select(hosts, include="c:5")
    with pytest.raises(HostsError, match="together"):
        select(hosts, include="a", exclude="b")
    with pytest.raises(HostsError, match="leaves no host"):
        select(hosts, exclude="a@b@c")


def test_environment_forwarded_by_rule_and_env_file(tmp_path: Path) -> None:
    (tmp_path / ".longboat_env").write_text("# ours\nexport NCCL_DEBUG=INFO\nMY_VAR='x y'\n")
    env = {
        "PYTHONPATH": "/src",
        "NCCL_IB_DISABLE": "1",
        "GLOO_SOCKET_IFNAME": "eth1",
        "LONGBOAT_X": "1",
        "LONGBOAT_LAUNCH_ID": "not this",  # each launch sets its own
        "HOME": str(tmp_path / "nohome"),
        "SECRET_TOKEN": "never",
        "PATH": "/bin",
    }
    assert forwarded(env, tmp_path) == {
        "PYTHONPATH": "/src",
        "NCCL_IB_DISABLE": "1",
        "GLOO_SOCKET_IFNAME": "eth1",
        "LONGBOAT_X": "1",
        "NCCL_DEBUG": "INFO",
        "MY_VAR": "x y",
    }
    (tmp_path / ".longboat_env").write_text("not a pair\n")
    with pytest.raises(EnvFileError, match=r"\.longboat_env:1: 'not a pair' is not KEY=VALUE"):
        forwarded(env, tmp_path)


def test_remote_command_keeps_directory_variables_and_arguments_intact() -> None:
    line = command_line(Path("/a dir"), {"X": "it's"}, ["python", "-c", "print(1); print(2)"])
    out = subprocess.run(
        ["sh", "-c", line.replace("exec env", "exec env -i")],  # no inherited variables
        capture_output=True,
        text=True,
        cwd="/",
    )
    # The directory does not exist: the shell says so, so the cd really is part of the line.
    assert "/a dir" in out.stderr
    assert make("ssh", 2222, ("IdentityFile=/k",)).argv("h", "true")[:9] == [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=30",
        "-p",
        "2222",
        "-o",
        "IdentityFile=/k",
    ]
    with pytest.raises(ValueError, match="--remote-shell 'rsh' is not known"):
        make("rsh")


def _hello(interfaces: dict[str, list[str]]) -> dict[str, object]:
    return {"interfaces": interfaces, "listening": {a: 1 for v in interfaces.values() for a in v}}


def test_discovery_keeps_only_interfaces_every_peer_reached() -> None:
    hello = {
        "h0": _hello({"docker0": ["172.17.0.1"], "eth0": ["10.0.0.1"]}),
        "h1": _hello({"docker0": ["172.17.0.1"], "ens5": ["10.0.0.2"]}),
        "h2": _hello({"ens5": ["10.0.0.3"], "wg0": ["10.9.0.3"]}),
    }
    results = {
        "h0": {"reached": [["h1", "ens5"], ["h2", "ens5"], ["h2", "wg0"]], "failed": {}},
        "h1": {"reached": [["h0", "eth0"], ["h2", "ens5"]], "failed": {"h2 wg0 10.9.0.3": "x"}},
        "h2": {
            "reached": [["h0", "eth0"], ["h1", "ens5"]],
            "failed": {"h0 docker0 172.17.0.1": "answered by another host (h2/..)"},
        },
    }
    found = _choose(["h0", "h1", "h2"], hello, results, 0.1)
    assert {h: n.chosen for h, n in found.hosts.items()} == {
        "h0": "eth0",
        "h1": "ens5",
        "h2": "ens5",
    }
    assert found.hosts["h2"].reachable == ["ens5"]  # wg0 only reached from h0
    assert found.hosts["h0"].address == "10.0.0.1"
    results["h1"]["reached"] = [["h2", "ens5"]]  # nobody reaches h0 from h1 any more
    with pytest.raises(DiscoveryError, match="host h0: no interface reached from every other host"):
        _choose(["h0", "h1", "h2"], hello, results, 0.1)


# ---------------------------------------------------------------- jobs across namespace hosts


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "longboat.cli", *args]


def _on_netns(hostfile: Path, *args: str) -> list[str]:
    """``longboat run --hostfile HOSTFILE --remote-shell netns ARGS``."""
    return _cli("run", "--hostfile", str(hostfile), "--remote-shell", "netns", *args)


def _run(argv: Sequence[str], **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, **kw
    )
    return done


def _results(out: str) -> list[tuple[str, int, int, str]]:
    """(host prefix, rank, world size, sum) per RESULT line."""
    pattern = r"^(?:(\S+): )?\[rank\d+\]: RESULT rank=(\d+) world_size=(\d+) sum=(\S+) "
    return [
        (m[1] or "", int(m[2]), int(m[3]), m[4]) for m in re.finditer(pattern, out, re.MULTILINE)
    ]


@pytest.fixture(scope="module")
def hosts3() -> Iterator[NetnsHosts]:
    if unavailable():
        pytest.skip(str(unavailable()))
    with netns_hosts(3) as hosts:
        yield hosts


def _hostfile(tmp_path: Path, hosts: Sequence[str], slots: Sequence[int] | int = 1) -> Path:
    counts = [slots] * len(hosts) if isinstance(slots, int) else list(slots)
    f = tmp_path / "hostfile"
    f.write_text("".join(f"{h} slots={n}\n" for h, n in zip(hosts, counts, strict=True)))
    return f


@needs_netns
def test_digits_across_three_hosts_equals_four_ranks_on_one_machine(
    hosts3: NetnsHosts, tmp_path: Path
) -> None:
    """The default example through --hostfile over namespace hosts (2 + 1 + 1 ranks): discovery
    skips the decoy, and the run is the very run 4 ranks make on one machine (same loss, same
    accuracy)."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    hostfile = _hostfile(tmp_path, hosts3.names, slots=(2, 1, 1))
    args = (str(DIGITS), "--epochs", "1")
    many = _run(_on_netns(hostfile, *args), env=env)
    assert many.returncode == 0, many.stderr[-3000:]
    one = _run(_cli("run", "-n", "4", *args))
    assert one.returncode == 0, one.stderr[-3000:]

    for i, name in enumerate(hosts3.names):
        assert f"{name} eth0 ({hosts3.addr(i)}), skipped docker0" in many.stderr
    last = re.compile(r"^(?:\S+: )?\[rank0\]: (steps=.*|accuracy=.*)$", re.MULTILINE)
    assert last.findall(many.stdout) == last.findall(one.stdout) != []
    assert re.search(rf"^{hosts3.names[0]}: \[rank0\]: accuracy=", many.stdout, re.MULTILINE)
    assert all(not hosts3.pids(n) for n in hosts3.names)  # nothing left on any host


def _per_node(
    hosts: NetnsHosts, launcher: Sequence[str], port: int, extra_env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Start node i in namespace i by hand (as on real machines), wait for both."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    env.update(extra_env or {})
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                hosts.names[i],
                *launcher,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--master-addr",
                hosts.addr(0),
                "--master-port",
                str(port),
                str(ALLREDUCE),
                "--timeout",
                "5",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for i in range(2)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@needs_netns
def test_wrong_interface_trap_reproduced_with_torchrun_and_avoided_per_node(
    hosts3: NetnsHosts,
) -> None:
    """Each host's name resolves to its docker bridge (172.18.0.1, on every host): torchrun's
    workers bind there and dial their own bridge. longboat's per-node agent routes gloo through
    the interface that reaches the master and the same job passes."""
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "1"]
    naive = _per_node(hosts3, torchrun, 29711)
    assert any(p.returncode != 0 for p in naive)
    said = "".join(p.stdout + p.stderr for p in naive)
    assert f"remote=[{DECOY_ADDR}]" in said, said[-3000:]

    ours = _per_node(hosts3, _cli("run", "-n", "1"), 29712)
    assert [p.returncode for p in ours] == [0, 0], ours[0].stderr[-2000:] + ours[1].stderr[-2000:]
    results = [r for p in ours for r in _results(p.stdout)]
    assert sorted(r[1:] for r in results) == [(0, 2, "3"), (0, 2, "3"), (1, 2, "3"), (1, 2, "3")]
    assert "gloo and NCCL use eth0 (10.77.0.2), the interface that reaches the master" in (
        ours[1].stderr
    )


@needs_netns
def test_no_job_listener_on_the_wildcard(hosts3: NetnsHosts, tmp_path: Path) -> None:
    """While a 3-host job waits between two all_reduces, every TCP listener on every host is
    bound to that host's job address (discovery's probe: to each address, on --master-port),
    none to 0.0.0.0 or ::."""
    hostfile = _hostfile(tmp_path, hosts3.names, slots=2)
    seen: dict[str, set[str]] = {n: set() for n in hosts3.names}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for n in hosts3.names:
                seen[n].update(hosts3.listeners(n))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run = _run(
            _on_netns(
                hostfile,
                "--master-port",
                "29720",
                str(ALLREDUCE),
                "--wait",
                "3",
            ),
        )
    finally:
        done.set()
        sampler.join()
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_results(run.stdout)) == 12  # 6 ranks x 2 all_reduces
    for i, name in enumerate(hosts3.names):
        assert seen[name], f"no listener seen on {name}: the sampler missed the run"
        wild = [a for a in seen[name] if a.startswith(("0.0.0.0:", "*:", "[::]:"))]
        assert not wild, f"{name} listened on the wildcard: {sorted(seen[name])}"
        # Discovery's probe listens on each candidate address, on --master-port only, before
        # the choice; everything after is on the chosen interface's address.
        others = {a for a in seen[name] if not a.startswith(f"{hosts3.addr(i)}:")}
        assert {a.rsplit(":", 1)[1] for a in others} <= {"29720"}, seen[name]
    ports0 = {int(a.rsplit(":", 1)[1]) for a in seen[hosts3.names[0]]}
    assert {29720, 29721} <= ports0  # the rendezvous store, then attempt 0's worker store


@needs_netns
def test_one_host_failing_stops_every_host(hosts3: NetnsHosts, tmp_path: Path) -> None:
    hostfile = _hostfile(tmp_path, hosts3.names)
    run = _run(
        _on_netns(
            hostfile,
            "--grace-period",
            "2",
            str(ALLREDUCE),
            "--wait",
            "60",
            "--fail-rank",
            "1",
        ),
    )
    assert run.returncode == 3, run.stderr[-3000:]
    assert f"longboat: host {hosts3.names[1]} failed (status 3); stopping" in run.stderr
    assert all(not hosts3.pids(n) for n in hosts3.names)


@needs_netns
def test_unreachable_hosts_are_each_named_before_anything_starts(
    hosts3: NetnsHosts, tmp_path: Path
) -> None:
    hostfile = _hostfile(tmp_path, [hosts3.names[0], "lbnohostA", "lbnohostB"])
    run = _run(_on_netns(hostfile, str(ALLREDUCE)))
    assert run.returncode == 1
    for missing in ("lbnohostA", "lbnohostB"):
        assert f"longboat: host {missing} cannot run commands through netns" in run.stderr
    assert "2 of 3 host(s) unreachable" in run.stderr
    assert "RESULT" not in run.stdout


@needs_netns
def test_a_cut_link_is_named_by_every_survivor_within_the_timeout(
    hosts3: NetnsHosts, tmp_path: Path
) -> None:
    """Two hosts train; host 1's link goes down mid-run. Each side names the other host as lost
    within comm.timeout_s + 1 s of the cut, and the job ends with a failure."""
    timeout_s = 5.0
    h0, h1 = hosts3.names[:2]
    hostfile = _hostfile(tmp_path, [h0, h1])
    proc = subprocess.Popen(
        _on_netns(hostfile, "--grace-period",
             "2", str(SCRIPTS / "train_until_cut.py"), str(timeout_s)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not all(any(f"{h}: [rank" in t and "STEP 20" in t for _, t in lines) for h in (h0, h1)):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(t for _, t in lines)
        time.sleep(0.1)
    cut = time.monotonic()
    hosts3.link(1, up=False)
    try:
        proc.wait(timeout=90)
    finally:
        hosts3.link(1, up=True)
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    said = "".join(t for _, t in lines)
    assert proc.returncode != 0, said[-3000:]
    for host, other in ((h0, h1), (h1, h0)):
        named = [
            when
            for when, t in lines
            if t.startswith(f"{host}: ") and f"lost: host {other} (node" in t
        ]
        assert named, f"{host} never named {other}:\n{said[-4000:]}"
        assert named[0] - cut <= timeout_s + 1, (named[0] - cut, said[-4000:])
    assert all(not hosts3.pids(n) for n in hosts3.names)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.skipif(sshd_unavailable() is not None, reason=str(sshd_unavailable()))
def test_a_real_ssh_launch(hosts3: NetnsHosts, tmp_path: Path) -> None:
    """OpenSSH's sshd on two namespace hosts, the launcher on the first (as on a login node
    that is also node 0): a job through ssh, then a host whose sshd is down named at the check."""
    h0, h1, h2 = hosts3.names
    with sshd_on(hosts3, [0, 1], tmp_path) as ssh_options:
        flags = ["--ssh-port", str(SSH_PORT)]
        for opt in ssh_options:
            flags += ["--ssh-option", opt]
        two = _hostfile(tmp_path, [h0, h1], slots=2)  # names resolve through /etc/netns hosts
        run = _run(
            ["ip", "netns", "exec", h0, *_cli("run", "--hostfile", str(two), *flags,
             "--master-port", "29730", str(ALLREDUCE))],
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        got = sorted(_results(run.stdout))
        assert [(h, r) for h, r, _, _ in got] == [(h0, 0), (h0, 0), (h0, 1), (h0, 1),
                                                  (h1, 2), (h1, 2), (h1, 3), (h1, 3)]  # fmt: skip
        assert {(w, s) for _, _, w, s in got} == {(4, "10")}

        # A rank failing on h1: h0's agent is stopped through ssh (its stdin closes).
        run = _run(
            ["ip", "netns", "exec", h0, *_cli("run", "--hostfile", str(two), *flags,
             "--grace-period", "2", str(ALLREDUCE), "--wait", "60", "--fail-rank", "2")],
        )  # fmt: skip
        assert run.returncode == 3, run.stderr[-3000:]
        assert f"longboat: host {h1} failed (status 3); stopping {h0}" in run.stderr
        left = [p for n in (h0, h1) for p in hosts3.pids(n) if "sshd" not in _cmdline(p)]
        assert not left, [_cmdline(p) for p in left]

        three = tmp_path / "three"
        three.write_text(f"{h0} slots=1\n{h1} slots=1\n{h2} slots=1\n")
        run = _run(
            ["ip", "netns", "exec", h0, *_cli("run", "--hostfile", str(three), *flags,
             str(ALLREDUCE))],
        )  # fmt: skip
        assert run.returncode == 1
        assert f"longboat: host {h2} cannot run commands through ssh" in run.stderr
        assert "Connection refused" in run.stderr
    assert all(not hosts3.pids(n) for n in hosts3.names)


# A made-up 4-GPU machine in nvidia-smi's layout: NVLink pairs 0-1 and 2-3, the rest over SYS.
TOPO = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity   GPU NUMA ID
GPU0     X      NV12    SYS     SYS     0-31    0               N/A
GPU1    NV12     X      SYS     SYS     0-31    0               N/A
GPU2    SYS     SYS      X      NV12    32-63   1               N/A
GPU3    SYS     SYS     NV12     X      32-63   1               N/A

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_device_links_read_and_neighbours_on_the_slowest_link_warned() -> None:
    from longboat.launch.doctor.topology import neighbour_warning, parse_topo

    links = parse_topo(TOPO)
    assert links == {
        (0, 1): "NV12", (0, 2): "SYS", (0, 3): "SYS",
        (1, 2): "SYS", (1, 3): "SYS", (2, 3): "NV12",
    }  # fmt: skip
    assert neighbour_warning("h", (0, 1, 2, 3), links) == ""  # one crossing is unavoidable
    bad = neighbour_warning("h", (0, 2, 1, 3), links)  # every neighbour pair crosses NUMA
    assert "GPU0-GPU2, GPU2-GPU1, GPU1-GPU3 talk over SYS" in bad
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 puts neighbours on faster links" in bad
    assert neighbour_warning("h", (0, 1), links) == ""
    assert parse_topo("NVIDIA-SMI has failed") == {}


@needs_netns
def test_doctor_shows_hosts_ranks_interfaces_and_devices(
    hosts3: NetnsHosts, tmp_path: Path
) -> None:
    hostfile = _hostfile(tmp_path, [*hosts3.names, "lbnohostC"], slots=(2, 1, 1, 1))
    wide = {**os.environ, "COLUMNS": "200"}
    args = ("doctor", "--hostfile", str(hostfile), "--remote-shell", "netns")
    bad = _run(_cli(*args), env=wide)
    assert bad.returncode == 1
    assert "FAIL host lbnohostC: `ip netns exec lbnohostC true` exited with status" in bad.stdout
    good = _run(_cli(*args, "--exclude", "lbnohostC"), env=wide)
    assert good.returncode == 0, good.stdout
    rows = [line for line in good.stdout.splitlines() if "skipped docker0" in line]
    for i, (name, ranks) in enumerate(zip(hosts3.names, ("0-1", "2-2", "3-3"), strict=True)):
        assert re.search(rf"{name} +│ {ranks} +│ eth0 \({hosts3.addr(i)}\)", rows[i]), rows
        assert "no NVIDIA GPU" in rows[i]


@needs_netns
def test_no_ssh_starts_this_hosts_node_from_the_host_list(
    hosts3: NetnsHosts, tmp_path: Path
) -> None:
    """DeepSpeed's --no_ssh: the same command on every host (a pod each, say); the host list
    gives the job's shape and node 0's name, which each host resolves (here /etc/netns)."""
    h0, h1 = hosts3.names[:2]
    hostfile = _hostfile(tmp_path, [h0, h1], slots=(2, 1))
    env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    procs = [
        subprocess.Popen(
            ["ip", "netns", "exec", h, *_cli("run", "--hostfile", str(hostfile), "--no-ssh",
             "--node-rank", str(i), "--master-port", "29740", str(ALLREDUCE))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
        )
        for i, h in enumerate((h0, h1))
    ]  # fmt: skip
    outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    results = sorted(r[1:] for out, _ in outs for r in _results(out))
    assert results == [(r, 3, "6") for r in (0, 0, 1, 1, 2, 2)]


def test_a_users_interface_is_kept_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from longboat.launch.discovery import Discovery, HostNetwork
    from longboat.launch.multihost import _check_user_interface

    net = {
        "h0": HostNetwork({"eth0": ["10.0.0.1"], "docker0": ["172.17.0.1"]}, ["eth0"], "eth0"),
        "h1": HostNetwork({"ens5": ["10.0.0.2"], "docker0": ["172.17.0.1"]}, ["ens5"], "ens5"),
    }
    found = Discovery(net, 0.1)
    _check_user_interface(found, {"GLOO_SOCKET_IFNAME": "docker0", "NCCL_SOCKET_IFNAME": "^lo"})
    err = capsys.readouterr().err
    assert "GLOO_SOCKET_IFNAME=docker0 on host h0, but the interfaces every other host" in err
    assert "reaches there are: eth0; kept as set (unset GLOO_SOCKET_IFNAME to use eth0)" in err
    assert "on host h1" in err and "NCCL_SOCKET_IFNAME" not in err  # an exclusion names none
    _check_user_interface(found, {"GLOO_SOCKET_IFNAME": "eth0,ens5"})  # right on both
    assert capsys.readouterr().err == ""


@needs_netns
def test_stopping_the_launcher_stops_every_host(hosts3: NetnsHosts, tmp_path: Path) -> None:
    """SIGTERM to the hostfile launcher: every host's workers get their grace period and stop,
    nothing is left in any namespace, and the launcher exits 128 + 15."""
    hostfile = _hostfile(tmp_path, hosts3.names[:2])
    proc = subprocess.Popen(
        _on_netns(hostfile, "--grace-period",
             "5", str(ALLREDUCE), "--wait", "120"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if sum("WAITING" in x for x in seen) == 2:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + rest
    assert all(not hosts3.pids(n) for n in hosts3.names)
