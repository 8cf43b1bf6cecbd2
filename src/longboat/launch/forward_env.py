"""Which of the launcher's environment variables reach the workers on other hosts.

ssh starts a bare login environment, so what a job needs is forwarded by rule, as DeepSpeed's
runner does: every variable whose name starts with one of :data:`PREFIXES`, then the lines of
``.longboat_env`` files (``KEY=VALUE``; ``~/.longboat_env`` first, then the one in the working
directory, later lines winning; ``LONGBOAT_ENV_FILE`` names another file instead). Variables the
launcher sets for the job itself (ranks, the interface) are added after these.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

PREFIXES = ("PYTHON", "NCCL_", "GLOO_", "LONGBOAT_", "TORCH_", "OMP_")
ENV_FILE = ".longboat_env"
# Set per launch by the agent itself; forwarding the launcher's own would mislead the workers.
_NOT_FORWARDED = frozenset(
    {"LONGBOAT_LAUNCH_ID", "LONGBOAT_ROLES_DIR", "LONGBOAT_REPORT_DIR", "LONGBOAT_STATE_DIR"}
)


class EnvFileError(ValueError):
    """A line of an env file that is not ``KEY=VALUE``."""


def env_files(env: Mapping[str, str], cwd: Path) -> list[Path]:
    """The env files to read, in order (missing ones are skipped)."""
    if env.get("LONGBOAT_ENV_FILE"):
        return [Path(env["LONGBOAT_ENV_FILE"])]
    home = Path(env.get("HOME", "~")).expanduser()
    paths = [home / ENV_FILE, cwd / ENV_FILE]
    return list(dict.fromkeys(p for p in paths if p.is_file()))


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines; ``#`` comments and blank lines skipped; ``export`` allowed."""
    out: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("export ").strip()
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise EnvFileError(
                f"{path}:{number}: {raw.strip()!r} is not KEY=VALUE; e.g. NCCL_DEBUG=INFO"
            )
        out[key.strip()] = value.strip().strip("'\"")
    return out


def forwarded(env: Mapping[str, str], cwd: Path) -> dict[str, str]:
    """The variables to set on every host, in the order they are applied."""
    out = {
        key: value
        for key, value in env.items()
        if key.startswith(PREFIXES) and key not in _NOT_FORWARDED
    }
    for path in env_files(env, cwd):
        out.update(read_env_file(path))
    return out
