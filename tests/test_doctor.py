"""`longboat doctor`: the checks as functions with injected facts, then the CLI as a user runs it.

The CLI tests run in a subprocess (each costs a few seconds of torch imports); the checks that
would need a broken machine (other versions on another node, a missing interface, a small
/dev/shm) are driven through the functions with the facts injected.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from longboat.launch.doctor import local, network
from longboat.launch.doctor.findings import Finding, exit_code
from longboat.launch.doctor.ranks import compare_ranks, run_ranks

TIMEOUT_S = 120
EXAMPLE_CONFIG = Path(__file__).parent.parent / "examples" / "digits.toml"

# Two interfaces as on a typical node: loopback and the cluster network.
FACTS = network.NetFacts(
    interfaces={"lo": ["127.0.0.1", "::1"], "eth0": ["10.1.2.3"]},
    route_ip="10.1.2.3",
    hostname="node1",
    hostname_ips=["127.0.1.1"],
)


def _rank_facts(rank: int, torch_version: str, host: str) -> dict[str, object]:
    return {
        "rank": rank,
        "local_rank": rank % 2,
        "node_rank": rank // 2,
        "host": host,
        "versions": {"python": "3.11.7", "torch": torch_version, "longboat": "0.1.0"},
        "interface": "eth0",
        "all_reduce_ok": True,
        "all_reduce_ms": 0.5,
    }


def _by_name(findings: Sequence[Finding]) -> dict[str, Finding]:
    return {f.name: f for f in findings}


# ----------------------------------------------------------------------------- the checks


def test_mismatched_versions_name_the_ranks_values_and_host() -> None:
    facts = [
        _rank_facts(0, "2.13.0", "a"),
        _rank_facts(1, "2.13.0", "a"),
        _rank_facts(2, "2.13.0", "b"),
        _rank_facts(3, "2.12.1", "b"),
    ]
    found = _by_name(compare_ranks(facts))
    torch_v = found["torch version"]
    assert torch_v.status == "fail"
    assert torch_v.detail == (
        "torch differs between ranks: 2.13.0 on ranks 0, 1, 2; 2.12.1 on rank 3"
    )
    assert torch_v.fix == "install the same torch everywhere, e.g. torch 2.13.0 on b"
    assert "python version" not in found  # only what differs is named
    assert found["all_reduce"].status == "ok"
    assert exit_code(list(found.values())) == 1


def test_matching_versions_and_a_wrong_all_reduce() -> None:
    facts = [_rank_facts(0, "2.13.0", "a"), _rank_facts(1, "2.13.0", "a")]
    assert [f.status for f in compare_ranks(facts)] == ["ok", "ok"]
    facts[1]["all_reduce_ok"] = False
    wrong = _by_name(compare_ranks(facts))["all_reduce"]
    assert (wrong.status, wrong.detail) == ("fail", "wrong all_reduce result on rank 1")


def test_interface_variable_naming_no_interface() -> None:
    f = network.check_interface("gloo", 2, {"GLOO_SOCKET_IFNAME": "nosuch0"}, FACTS)
    assert f.status == "fail"
    assert "GLOO_SOCKET_IFNAME=nosuch0 names no interface here (nosuch0)" in f.detail
    assert "lo (127.0.0.1, ::1), eth0 (10.1.2.3)" in f.detail
    assert f.fix.startswith("export GLOO_SOCKET_IFNAME=eth0")


@pytest.mark.parametrize(
    ("value", "status"),
    [
        ("eth", "ok"),  # NCCL matches prefixes
        ("=eth", "fail"),  # "=" asks for the exact name
        ("^docker,lo", "ok"),  # an exclusion list names nothing that must exist
        ("ib", "fail"),
    ],
)
def test_nccl_interface_variable_syntax(value: str, status: str) -> None:
    f = network.check_interface("nccl", 1, {"NCCL_SOCKET_IFNAME": value}, FACTS)
    assert f.status == status, f


def test_gloo_on_loopback_for_several_nodes_gets_the_export_to_use() -> None:
    # The hostname resolves to 127.0.1.1 (as Debian sets it up): gloo falls back to loopback.
    f = network.check_interface("gloo", 2, {}, FACTS)
    assert f.status == "warn"
    assert f.detail.startswith("gloo would use lo (hostname node1 resolves to no local address")
    assert f.fix == "export GLOO_SOCKET_IFNAME=eth0"
    # One node: loopback is right.
    assert network.check_interface("gloo", 1, {}, FACTS).status == "ok"
    # With the variable set to the routed interface, nothing to fix.
    ok = network.check_interface("gloo", 2, {"GLOO_SOCKET_IFNAME": "eth0"}, FACTS)
    assert ok.status == "ok", ok


def test_nccl_default_interface_skips_loopback_and_docker() -> None:
    facts = network.NetFacts(
        interfaces={"lo": ["127.0.0.1"], "docker0": ["172.17.0.1"], "eth0": ["10.1.2.3"]},
        route_ip="10.1.2.3",
        hostname="n",
        hostname_ips=[],
    )
    assert network.backend_interface("nccl", {}, facts)[0] == "eth0"


def test_busy_master_port_is_named_with_the_fix() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        f = network.check_master("127.0.0.1", port, node_rank=0)
    assert f.status == "fail"
    assert f.detail == f"port {port} on 127.0.0.1 is already in use"
    assert "pick another --master-port" in f.fix
    assert network.check_master("127.0.0.1", None, node_rank=0).status == "ok"


def test_loopback_master_for_several_nodes_fails() -> None:
    f = network.check_master("127.0.0.1", 29500, node_rank=0, nnodes=2)
    assert f.status == "fail"
    assert "loopback address" in f.detail


def test_unresolvable_master() -> None:
    f = network.check_master("no-such-host.invalid", 29500, node_rank=1, nnodes=2)
    assert (f.status, f.detail) == ("fail", "--master-addr no-such-host.invalid does not resolve")


def test_batch_config_that_does_not_divide(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[batch]\ntrain_batch_size = 64\nmicro_batch_size = 6\n")
    f = local.check_config(cfg, 2)
    assert f is not None and f.status == "fail"
    assert "train_batch_size=64 is not divisible by micro_batch_size=6" in f.detail
    assert "(world size 2)" in f.detail
    assert f.fix.startswith("choose a train_batch_size that is a multiple of 12")
    good = local.check_config(EXAMPLE_CONFIG, 4)
    assert good is not None and good.status == "ok"
    assert "train_batch_size 64 = micro 16 x accumulation 1 x 4 ranks" in good.detail


def test_small_or_missing_shm_warns_with_the_docker_fix() -> None:
    small = local.check_shm(64 * 1024**2)
    assert small.status == "warn" and "--shm-size" in small.fix
    assert local.check_shm(None).status == "warn"
    assert local.check_shm(8 * local.GIB).status == "ok"


def test_backend_availability() -> None:
    cpu = local.Backends(gloo=True, nccl=True, mpi=False, cuda_devices=0)
    assert local.check_backend("gloo", cpu).status == "ok"
    nccl = local.check_backend("nccl", cpu)
    assert nccl.status == "fail" and "CUDA_VISIBLE_DEVICES" in nccl.fix
    assert local.check_backend("mpi", cpu).status == "fail"
    gpus = local.Backends(gloo=True, nccl=True, mpi=False, cuda_devices=2)
    too_many = local.check_gpus_per_node("nccl", 4, gpus)
    assert too_many is not None and too_many.fix.startswith("use -n 2 or fewer")
    assert local.check_gpus_per_node("nccl", 2, gpus) is None


def test_a_node_alone_fails_to_join_within_the_timeout() -> None:
    # Node 0 of two, and node 1 never comes: the join itself is the finding.
    findings, facts = run_ranks(1, 2, 0, "127.0.0.1", _free_port(), "gloo", timeout_s=2)
    assert facts == []
    [f] = findings
    assert (f.name, f.status) == ("ranks", "fail")
    assert "did not all join within 2 s" in f.detail
    assert "firewall" in f.fix and "GLOO_SOCKET_IFNAME" in f.fix


# ----------------------------------------------------------------------------- the CLI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``longboat ARGS`` with a hard timeout; a wide terminal keeps table rows whole."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    cmd = [sys.executable, "-m", "longboat.cli", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {TIMEOUT_S}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_doctor_two_ranks_on_this_machine_passes() -> None:
    r = _cli("doctor", "-n", "2", "--config", str(EXAMPLE_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    host = socket.gethostname()
    rows = re.findall(rf"│ (\d) +│ 0 +│ {re.escape(host)} +│", r.stdout)
    assert rows == ["0", "1"], r.stdout
    assert "all checks passed" in r.stdout
    assert "train_batch_size 64 = micro 32 x accumulation 1 x 2 ranks" in r.stdout


def test_doctor_bad_batch_config_exits_1_naming_keys_and_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[batch]\ntrain_batch_size = 63\n")
    r = _cli("doctor", "-n", "2", "--config", str(cfg))
    assert r.returncode == 1, r.stdout + r.stderr
    assert re.search(
        r"FAIL config: .*train_batch_size=63 is not divisible by "
        r"gradient_accumulation_steps=1 x data-parallel size 2",
        r.stdout,
    )
    assert "fix: choose a train_batch_size that is a multiple of 2" in r.stdout
    assert "all checks passed" not in r.stdout


def test_doctor_busy_port_is_named() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        r = _cli("doctor", "-n", "2", "--master-port", str(port))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAIL master: port {port} on 127.0.0.1 is already in use" in r.stdout
    assert "fix: pick another --master-port" in r.stdout
    assert "WARN ranks: not started" in r.stdout


def test_doctor_missing_gloo_interface_lists_the_real_ones() -> None:
    import psutil

    r = _cli("doctor", "--backend", "gloo", env={"GLOO_SOCKET_IFNAME": "nosuch0"})
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("FAIL interface:"))
    assert "GLOO_SOCKET_IFNAME=nosuch0 names no interface here" in line
    for name in psutil.net_if_addrs():
        assert name in line
    assert "fix: export GLOO_SOCKET_IFNAME=" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("doctor", "-n", "0"),
        ("doctor", "--nnodes", "2"),  # multi-node needs --master-port
        ("doctor", "--backend", "tcp"),
        ("doctor", "--config", "no/such.toml"),
        ("doctor", "--rdzv-timeout", "0"),
        ("run", "--doctor", "-n", "0", "x.py"),
    ],
)
def test_usage_errors_exit_2(args: tuple[str, ...], tmp_path: Path) -> None:
    if args[0] == "run":
        script = tmp_path / "x.py"
        script.write_text("")
        args = (*args[:-1], str(script))
    r = _cli(*args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("longboat: error: ")


@pytest.fixture
def marker_script(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A script that leaves a file per rank, proving it ran."""
    script = tmp_path / "mark.py"
    script.write_text(
        "import os, pathlib, sys\n"
        "pathlib.Path(sys.argv[1], 'ran' + os.environ['RANK']).write_text('x')\n"
    )
    yield script, tmp_path


def test_run_doctor_with_a_failing_check_does_not_start_the_script(
    marker_script: tuple[Path, Path],
) -> None:
    script, out = marker_script
    # One rank needs no interface, so without --doctor this run would start.
    r = _cli(
        "run",
        "--doctor",
        "-n",
        "1",
        str(script),
        str(out),
        env={"GLOO_SOCKET_IFNAME": "nosuch0", "NCCL_SOCKET_IFNAME": "nosuch0"},
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL interface" in r.stdout
    assert "not starting" in r.stderr
    assert not list(out.glob("ran*"))
    # The same run without --doctor starts the script: the preflight is what held it back.
    r = _cli(
        "run",
        "-n",
        "1",
        str(script),
        str(out),
        env={"GLOO_SOCKET_IFNAME": "nosuch0", "NCCL_SOCKET_IFNAME": "nosuch0"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert [p.name for p in out.glob("ran*")] == ["ran0"]


def test_run_doctor_with_passing_checks_runs_the_script(marker_script: tuple[Path, Path]) -> None:
    script, out = marker_script
    r = _cli("run", "--doctor", "-n", "2", str(script), str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    assert sorted(p.name for p in out.glob("ran*")) == ["ran0", "ran1"]


def _non_loopback_ipv4() -> str | None:
    import ipaddress

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def test_two_nodes_on_this_machine_meet_and_both_show_every_rank() -> None:
    addr = _non_loopback_ipv4()
    if addr is None:
        pytest.skip("no non-loopback IPv4 address here to act as node 0's")
    port = str(_free_port())
    common = (
        "doctor",
        "--nnodes",
        "2",
        "--master-addr",
        addr,
        "--master-port",
        port,
        "--rdzv-timeout",
        "60",
    )
    env = {**os.environ, "COLUMNS": "200"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "longboat.cli", *common, "--node-rank", str(k)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for k in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, (out, err) in zip(procs, outs, strict=True):
        # Warnings are allowed (e.g. gloo on loopback here); no failure.
        assert p.returncode == 0, out + err
        assert re.findall(r"│ (\d) +│ (\d) +│", out) == [("0", "0"), ("1", "1")], out
        assert re.search(r"rank versions +│ ok", out), out
