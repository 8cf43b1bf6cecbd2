"""Several "hosts" on this machine: Linux network namespaces joined by veth pairs to a switch.

Layout (per :class:`NetnsHosts`, every name carrying a random tag so runs never collide)::

    <tag>sw:   bridge br0  <- veth v0, v1, ...
    <tag>h0:   eth0 10.77.0.1/24 (peer v0)   docker0 172.18.0.1/16 (bridge, no peers)
    <tag>h1:   eth0 10.77.0.2/24 (peer v1)   docker0 172.18.0.1/16
    ...

``docker0`` is the decoy: a bridge with the same address on every host that leads nowhere, as
docker leaves on real machines. Each host's ``/etc/hosts`` (``ip netns exec`` bind-mounts
``/etc/netns/<name>/hosts``) maps this machine's hostname to the decoy's address, so gloo left to
itself binds there, the wrong-interface trap. Traffic stays on loopback and these addresses.

Everything is removed on exit, also after a failure: processes still in a namespace are killed,
then the namespaces and their ``/etc/netns`` files are deleted. Needs root and ``ip``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SUBNET = "10.77.0"
DECOY_ADDR = "172.18.0.1"
_NETNS_ETC = Path("/etc/netns")


def unavailable() -> str | None:
    """Why namespace hosts cannot be built here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root, as CI does)"
    if shutil.which("ip") is None:
        return "network namespaces need the `ip` command (Debian: apt-get install iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class NetnsHosts:
    """``n`` namespace hosts; :attr:`names` for the hostfile, :meth:`addr` for their eth0."""

    def __init__(self, n: int) -> None:
        self.tag = "lb" + secrets.token_hex(3)
        self.switch = f"{self.tag}sw"
        self.names = [f"{self.tag}h{i}" for i in range(n)]

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def veth(self, i: int) -> str:
        """The switch-side end of host ``i``'s link (set it down to cut the host off)."""
        return f"v{i}"

    def create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                name,
                "type",
                "veth",
                "peer",
                "name",
                self.veth(i),
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", self.veth(i), "master", "br0")
            _ip("-n", self.switch, "link", "set", self.veth(i), "up")
            _ip("-n", name, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "add", "docker0", "type", "bridge")
            _ip("-n", name, "addr", "add", f"{DECOY_ADDR}/16", "dev", "docker0")
            _ip("-n", name, "link", "set", "docker0", "up")
            etc = _NETNS_ETC / name
            etc.mkdir(parents=True, exist_ok=True)
            hostname = socket.gethostname()
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n{DECOY_ADDR} {hostname}\n"
                + "".join(f"{self.addr(j)} {h}\n" for j, h in enumerate(self.names))
            )
        self.wait_connected()

    def pids(self, name: str) -> list[int]:
        """Processes running in namespace ``name``."""
        out = subprocess.run(
            ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30
        )
        return [int(p) for p in out.stdout.split()]

    def remove(self) -> None:
        """Kill what runs inside, delete every namespace and its /etc/netns files."""
        for name in [*self.names, self.switch]:
            for pid in self.pids(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)
        with contextlib.suppress(OSError):  # only when empty: someone else's files stay
            _NETNS_ETC.rmdir()

    def link(self, i: int, up: bool) -> None:
        """Connect (``up``) or cut host ``i`` from the switch. Reconnecting returns once every
        host reaches every other again: a test after it must not meet the cut's leftovers."""
        _ip("-n", self.switch, "link", "set", self.veth(i), "up" if up else "down")
        if up:
            self.wait_connected()

    def wait_connected(self, timeout_s: float = 30.0) -> None:
        """Wait (bounded) until a TCP connect from each host to each other host's eth0 is
        answered, refused or accepted. Neighbour entries left FAILED by a cut, and a port the
        switch has not yet learned, otherwise make the next connect fail with "No route to
        host"."""
        addrs = [self.addr(j) for j in range(len(self.names))]
        probe = (
            "import socket, sys\n"
            "bad = []\n"
            f"for a in {addrs!r}:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try: s.connect((a, 9))\n"
            "    except ConnectionRefusedError: pass\n"
            "    except OSError as e: bad.append(f'{a}: {e}')\n"
            "    finally: s.close()\n"
            "print('; '.join(bad))\n"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            failed = {}
            for name in self.names:
                out = subprocess.run(
                    ["ip", "netns", "exec", name, sys.executable, "-c", probe],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                if out.stdout.strip() or out.returncode != 0:
                    failed[name] = out.stdout.strip() or out.stderr.strip()
            if not failed:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace hosts still cut off after {timeout_s} s: {failed}")
            for name in self.names:
                subprocess.run(["ip", "-n", name, "neigh", "flush", "all"],
                               capture_output=True, timeout=30)  # fmt: skip
            time.sleep(0.5)

    def listeners(self, name: str) -> list[str]:
        """Local addresses of the TCP listeners in namespace ``name`` (``ss -ltn``)."""
        out = subprocess.run(
            ["ip", "netns", "exec", name, "ss", "-Hltn"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return [line.split()[3] for line in out.stdout.splitlines() if line.strip()]


SSH_PORT = 2222


def sshd_unavailable() -> str | None:
    """Why a real sshd cannot be started in a namespace here (None when it can)."""
    if shutil.which("sshd", path="/usr/sbin:/usr/bin") is None or shutil.which("ssh") is None:
        return "no OpenSSH server here (Debian: apt-get install openssh-server)"
    return unavailable()


@contextmanager
def sshd_on(hosts: NetnsHosts, indices: list[int], workdir: Path) -> Iterator[list[str]]:
    """A private sshd (own host key, own authorized key, nothing of /etc/ssh) listening on
    ``SSH_PORT`` at each chosen host's eth0. Yields the ssh options that log in with its key."""
    key = workdir / "id"
    for name in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(workdir / name)],
                       check=True, timeout=30)  # fmt: skip
    (workdir / "authorized_keys").write_text((workdir / "id.pub").read_text())
    made_run_dir = not Path("/run/sshd").exists()  # sshd insists on its privilege-separation dir
    if made_run_dir:
        Path("/run/sshd").mkdir(mode=0o755)
    daemons = []
    try:
        for i in indices:
            config = workdir / f"sshd_config{i}"
            config.write_text(
                f"ListenAddress {hosts.addr(i)}\nPort {SSH_PORT}\nHostKey {workdir}/host_key\n"
                f"PidFile {workdir}/sshd{i}.pid\nAuthorizedKeysFile {workdir}/authorized_keys\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nMaxStartups 64\n"
            )
            log = open(workdir / f"sshd{i}.log", "w")  # noqa: SIM115 (closed with the daemon)
            daemons.append((subprocess.Popen(
                ["ip", "netns", "exec", hosts.names[i], "/usr/sbin/sshd", "-f", str(config),
                 "-D", "-e"], stdout=log, stderr=log), log))  # fmt: skip
        for i in indices:  # ready once it says so
            log_file = workdir / f"sshd{i}.log"
            for _ in range(100):
                if "Server listening" in log_file.read_text():
                    break
                time.sleep(0.1)
        yield [
            f"IdentityFile={key}",
            "IdentitiesOnly=yes",
            "StrictHostKeyChecking=no",
            "UserKnownHostsFile=/dev/null",
            "LogLevel=ERROR",
        ]
    finally:
        for proc, log in daemons:
            proc.kill()
            proc.wait(timeout=30)
            log.close()
        if made_run_dir:
            shutil.rmtree("/run/sshd", ignore_errors=True)


@contextmanager
def netns_hosts(n: int) -> Iterator[NetnsHosts]:
    """Build ``n`` namespace hosts; remove them on exit whatever happened."""
    hosts = NetnsHosts(n)
    try:
        hosts.create()
        yield hosts
    finally:
        hosts.remove()
