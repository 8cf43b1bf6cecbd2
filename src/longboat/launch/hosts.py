"""The hosts of a multi-machine job: a hostfile or ``-H``, narrowed by ``--include/--exclude``.

The syntax is DeepSpeed's and Horovod's, so their users' files work unchanged:

* hostfile: one ``host slots=N`` per line; ``#`` starts a comment; blank lines are skipped; a
  host listed twice is refused (DeepSpeed refuses it too: which count would be meant?);
* ``-H host1:2,host2:2`` (Horovod's ``-H``): ``host[:slots]``, one slot when left out;
* ``--include`` / ``--exclude`` (DeepSpeed's meaning): ``host1@host2:0,2`` — hosts separated by
  ``@``, each with an optional ``:`` list of slot indices; a host without indices means all of
  its slots. ``--include`` keeps only what it names, ``--exclude`` drops what it names; the two
  together are refused.

A host's slots are its ranks. When only some slot indices are kept, the host runs one rank per
kept index and its workers see ``CUDA_VISIBLE_DEVICES`` set to those indices, as with DeepSpeed.

Pure functions, no torch: usage errors come back before anything heavy is imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?\s*$")


class HostsError(ValueError):
    """A hostfile, ``-H`` or include/exclude problem; the message names the value and the fix."""


@dataclass(frozen=True)
class Host:
    """One machine of the job and the slot indices it runs ranks on."""

    name: str
    slots: tuple[int, ...]

    @property
    def nproc(self) -> int:
        """Ranks (worker processes) on this host."""
        return len(self.slots)

    @property
    def all_slots(self) -> bool:
        """True when the host runs every slot from 0 up (no device selection needed)."""
        return self.slots == tuple(range(len(self.slots)))


def _slots(value: str, where: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise HostsError(f"{where}: slots={value!r} is not a positive whole number; e.g. slots=4")
    return n


def parse_hostfile(path: Path) -> list[Host]:
    """Read a DeepSpeed/Horovod hostfile (``host slots=N`` per line)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise HostsError(
            f"--hostfile {str(path)!r} cannot be read ({e.strerror or e}); give a file with one "
            "`host slots=N` per line"
        ) from None
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        m = _HOSTFILE_LINE.match(line)
        if not m:
            raise HostsError(
                f"{where}: {raw.strip()!r} is not `host slots=N`; e.g. `worker-1 slots=4`"
            )
        name = m["host"]
        if name in seen:
            raise HostsError(
                f"{where}: host {name!r} is listed twice (first on line {seen[name]}); list "
                "each host once with its total slots"
            )
        seen[name] = number
        n = _slots(m["slots"], where) if m["slots"] is not None else 1
        hosts.append(Host(name, tuple(range(n))))
    if not hosts:
        raise HostsError(
            f"--hostfile {str(path)!r} lists no host; give one `host slots=N` per line"
        )
    return hosts


def parse_host_list(text: str) -> list[Host]:
    """Horovod's ``-H host1:2,host2:2`` (a host without ``:N`` has one slot)."""
    hosts: list[Host] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        if not name:
            raise HostsError(f"-H {text!r}: {item!r} has no host name; e.g. -H node1:4,node2:4")
        if any(h.name == name for h in hosts):
            raise HostsError(f"-H {text!r}: host {name!r} is listed twice; list each host once")
        n = _slots(count, f"-H {text!r}") if count else 1
        hosts.append(Host(name, tuple(range(n))))
    if not hosts:
        raise HostsError(f"-H {text!r} names no host; e.g. -H node1:4,node2:4")
    return hosts


def _selection(text: str, flag: str, hosts: list[Host]) -> dict[str, tuple[int, ...] | None]:
    """``host1@host2:0,2`` -> {host1: None (all slots), host2: (0, 2)}; names checked."""
    known = {h.name: h for h in hosts}
    out: dict[str, tuple[int, ...] | None] = {}
    for item in (part.strip() for part in text.split("@")):
        if not item:
            continue
        name, _, indices = item.partition(":")
        if name not in known:
            raise HostsError(
                f"{flag} {text!r}: host {name!r} is not in the host list "
                f"({', '.join(known)}); name hosts as the hostfile or -H does"
            )
        if not indices:
            out[name] = None
            continue
        try:
            slots = tuple(sorted({int(i) for i in indices.split(",") if i.strip()}))
        except ValueError:
            raise HostsError(
                f"{flag} {text!r}: {indices!r} are not slot indices; e.g. {name}:0,1"
            ) from None
        bad = [s for s in slots if s not in known[name].slots]
        if bad or not slots:
            raise HostsError(
                f"{flag} {text!r}: host {name!r} has slots 0..{known[name].nproc - 1}, not "
                f"{bad or indices}"
            )
        out[name] = slots
    if not out:
        raise HostsError(f"{flag} {text!r} names no host; e.g. {flag} {hosts[0].name}")
    return out


def select(hosts: list[Host], include: str | None = None, exclude: str | None = None) -> list[Host]:
    """Apply DeepSpeed's ``--include`` or ``--exclude``; hosts left with no slot are dropped."""
    if include and exclude:
        raise HostsError("--include and --exclude together: give one of them (DeepSpeed's rule)")
    if include:
        kept = _selection(include, "--include", hosts)
        hosts = [
            Host(h.name, h.slots if kept[h.name] is None else kept[h.name])  # type: ignore[arg-type]
            for h in hosts
            if h.name in kept
        ]
    elif exclude:
        dropped = _selection(exclude, "--exclude", hosts)
        out = []
        for h in hosts:
            if h.name not in dropped:
                out.append(h)
            elif (gone := dropped[h.name]) is not None:
                left = tuple(s for s in h.slots if s not in gone)
                if left:
                    out.append(Host(h.name, left))
        hosts = out
    if not hosts:
        raise HostsError(
            f"--exclude {exclude!r} leaves no host to run on; exclude fewer hosts or slots"
        )
    return hosts
