"""``ssh``: run on another machine, never prompting (``BatchMode``): a missing key fails fast."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ssh:
    """OpenSSH's client; ``options`` are extra ``-o KEY=VALUE`` settings."""

    port: int | None = None
    options: tuple[str, ...] = ()
    name: str = "ssh"

    def _base(self, timeout_s: int) -> list[str]:
        argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        for opt in self.options:
            argv += ["-o", opt]
        return argv

    def argv(self, host: str, command: str) -> list[str]:
        """``ssh host command``: sshd hands the string to the remote login shell."""
        # No -tt: a pseudo-terminal would mix stderr into stdout and echo input. The remote
        # agent stops when its stdin closes, which ssh passes on when it exits or is killed.
        return [*self._base(30), host, command]

    def check_argv(self, host: str, timeout_s: int) -> list[str]:
        """``ssh host true``: fails on an unreachable host, a refused key or no sshd."""
        return [*self._base(timeout_s), host, "true"]
