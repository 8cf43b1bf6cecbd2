"""Remote shells: how the launcher starts a command on another host.

A shell turns (host, shell command) into the local argv that runs the command there, with the
remote side's stdin, stdout and stderr joined to the local process's. ``ssh`` is for machines;
``netns`` runs in a Linux network namespace of this machine (how the tests build several hosts).
The command is a POSIX shell command line: the launcher ``cd``s, sets variables and ``exec``s.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol


class RemoteShell(Protocol):
    """Start a shell command on a host."""

    @property
    def name(self) -> str:
        """What ``--remote-shell`` calls it (read only: the shells are frozen dataclasses)."""
        ...

    def argv(self, host: str, command: str) -> list[str]:
        """The local command line that runs ``command`` (a shell string) on ``host``."""
        ...

    def check_argv(self, host: str, timeout_s: int) -> list[str]:
        """A command that exits 0 quickly when ``host`` can run commands, else fails."""
        ...


def make(name: str, ssh_port: int | None = None, ssh_options: tuple[str, ...] = ()) -> RemoteShell:
    """The shell called ``name`` (one of :data:`NAMES`)."""
    from longboat.launch.shells.netns import Netns
    from longboat.launch.shells.ssh import Ssh

    shells: dict[str, RemoteShell] = {
        "ssh": Ssh(port=ssh_port, options=ssh_options),
        "netns": Netns(),
    }
    if name not in shells:
        raise ValueError(
            f"--remote-shell {name!r} is not known: use one of {', '.join(NAMES)} (ssh for "
            "machines, netns for network namespaces of this machine)"
        )
    return shells[name]


NAMES = ("ssh", "netns")


def command_line(cwd: Path, env: Mapping[str, str], argv: Sequence[str]) -> str:
    """``cd CWD && exec env K=V ... ARGV``: the same directory and variables on the remote host,
    and the remote shell replaced by the command (so signals and stdin reach it directly)."""
    assigns = [f"{key}={value}" for key, value in env.items()]
    return f"cd {shlex.quote(str(cwd))} && exec " + shlex.join(["env", *assigns, *argv])
