"""The host-list options ``run`` and ``doctor`` share, and their parsing into hosts and a shell."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from longboat.cli.app import usage_error

if TYPE_CHECKING:
    from longboat.launch.hosts import Host
    from longboat.launch.shells import RemoteShell

HOSTFILE = typer.Option(
    None,
    "--hostfile",
    help="the job's hosts, `host slots=N` per line (DeepSpeed's and Horovod's format): one node "
    "per host, slots ranks each, started through --remote-shell",
)
HOSTS = typer.Option(
    None, "-H", "--hosts", help="hosts as host:slots,... (Horovod's -H), instead of --hostfile"
)
INCLUDE = typer.Option(
    None,
    "--include",
    help="only these hosts/slots of the host list, e.g. host1@host2:0,1 (DeepSpeed's flag)",
)
EXCLUDE = typer.Option(
    None, "--exclude", help="leave out these hosts/slots, e.g. host3@host1:2,3 (DeepSpeed's)"
)
REMOTE_SHELL = typer.Option(
    "ssh",
    "--remote-shell",
    help="how hosts run commands: ssh, or netns (network namespaces of this machine, for tests)",
)
SSH_PORT = typer.Option(None, "--ssh-port", help="sshd's port on the hosts")
SSH_OPTION = typer.Option(None, "--ssh-option", help="an extra ssh -o KEY=VALUE (repeatable)")


def parse_hosts(hostfile: Path | None, host_list: str | None) -> list[Host] | None:
    """The hosts of ``--hostfile`` or ``-H`` (None without either); usage errors exit 2."""
    from longboat.launch import hosts as hostlist

    if hostfile is None and host_list is None:
        return None
    if hostfile is not None and host_list is not None:
        raise usage_error("--hostfile and -H/--hosts together: give the hosts one way")
    try:
        if hostfile is not None:
            return hostlist.parse_hostfile(hostfile)
        return hostlist.parse_host_list(host_list or "")
    except ValueError as e:
        raise usage_error(str(e)) from None


def hosts_and_shell(
    hostfile: Path | None,
    host_list: str | None,
    include: str | None,
    exclude: str | None,
    remote_shell: str,
    ssh_port: int | None,
    ssh_option: list[str] | None,
) -> tuple[list[Host], RemoteShell] | None:
    """The hosts to run on and how to reach them; None without --hostfile or -H."""
    from longboat.launch import hosts as hostlist
    from longboat.launch import shells

    found = parse_hosts(hostfile, host_list)
    if found is None:
        if include or exclude:
            raise usage_error("--include/--exclude choose among --hostfile or -H hosts; give one")
        return None
    try:
        chosen = hostlist.select(found, include, exclude)
        return chosen, shells.make(remote_shell, ssh_port, tuple(ssh_option or ()))
    except ValueError as e:
        raise usage_error(str(e)) from None
