"""Checking a checkpoint's files against its manifest before anything is loaded."""

from __future__ import annotations

from pathlib import Path

from longboat.checkpoint.errors import CheckpointError
from longboat.checkpoint.manifest import Manifest
from longboat.checkpoint.tensorfile import checksum


def file_problems(path: Path, manifest: Manifest, names: list[str]) -> list[str]:
    """What is wrong with each of ``names`` (files of the checkpoint at ``path``): missing, of
    the wrong size, or with the wrong SHA-256, naming the tensors whose bytes changed."""
    wanted: dict[str, dict[str, tuple[str, str]]] = {}  # file -> {key in file: (what, sha256)}
    for name, keys in manifest.tensors.items():
        for key, e in keys.items():
            for s in e.shards:
                wanted.setdefault(s.file, {})[s.key] = (f"{key} of {name!r}", s.sha256)
    problems = []
    for f in names:
        rec = manifest.files[f]
        p = path / f
        if not p.is_file():
            problems.append(f"'{p}' is missing")
            continue
        got = checksum(p)
        if got.sha256 == rec["sha256"] and got.bytes == rec["bytes"]:
            continue
        got = checksum(p, per_tensor=True)  # a second pass, only for a file that failed
        what = (
            f"has {got.bytes} bytes where the manifest records {rec['bytes']}"
            if got.bytes != rec["bytes"]
            else "does not match its checksum"
        )
        changed = [
            desc for k, (desc, sha) in wanted.get(f, {}).items() if got.tensors.get(k) != sha
        ]
        detail = f"; tensors affected: {', '.join(changed[:6])}" if changed else ""
        problems.append(
            f"'{p}' {what} (SHA-256 {got.sha256}, the manifest records {rec['sha256']}){detail}"
        )
    return problems


def share(manifest: Manifest, rank: int, world_size: int) -> list[str]:
    """The files ``rank`` checks: every file by exactly one rank, largest first to the rank with
    the fewest bytes so far (the same answer on every rank)."""
    load = [0] * world_size
    mine = []
    for f in sorted(manifest.files, key=lambda f: (-int(manifest.files[f]["bytes"]), f)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += int(manifest.files[f]["bytes"])
        if r == rank:
            mine.append(f)
    return mine


def verify_files(path: Path, manifest: Manifest, rank: int, world_size: int) -> None:
    """Verify this rank's share of the files (see :func:`share`)."""
    mine = share(manifest, rank, world_size)
    problems = file_problems(path, manifest, mine)
    if problems:
        raise CheckpointError(
            "checkpoint files failed verification, nothing was loaded:\n  " + "\n  ".join(problems)
        )
