"""Where things live in a checkpoint directory, and which checkpoint is the one to load.

::

    DIR/
      latest                      the tag of the newest complete checkpoint (moved last)
      step-00000100/              one directory per tag, complete once renamed into place
        manifest.json             written last inside it; see manifest.py
        state.json                engine counters, scheduler, loaders, optimizer groups, client
        rank-00000.safetensors    the tensors rank 0 wrote
        rank-00000.json           rank 0's RNG states and optimizer scalars
        ...
      .tmp-<tag>-<nonce>/         a save in progress (or one a crash interrupted): ignored
      .old-<tag>-<nonce>/         a checkpoint being replaced by one with the same tag: ignored

A directory counts as a checkpoint only if its name is a valid tag and it holds a manifest.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from longboat.checkpoint.errors import CheckpointError
from longboat.checkpoint.fsio import read_json, replace_durably

log = logging.getLogger("longboat")

MANIFEST = "manifest.json"
STATE = "state.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
_LATEST_MAX_BYTES = 256


def tensor_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def default_tag(step: int) -> str:
    return f"step-{step:08d}"


def is_valid_tag(tag: str) -> bool:
    return bool(_TAG.fullmatch(tag)) and tag != LATEST


def check_tag(tag: str) -> None:
    """Refuse a tag that is not a plain directory name."""
    if not is_valid_tag(tag):
        raise CheckpointError(
            f"checkpoint tag {tag!r} is invalid: use letters, digits and '._+-' (up to 128, not "
            f"starting with '.' or '-', not {LATEST!r}), e.g. 'step-100'"
        )


def read_latest(root: Path) -> str | None:
    """The tag ``latest`` names, or None when it is absent or not a valid tag (a damaged or
    foreign file is never interpreted beyond a short line of text)."""
    path = root / LATEST
    try:
        with open(path, "rb") as f:
            raw = f.read(_LATEST_MAX_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if len(raw) > _LATEST_MAX_BYTES or not is_valid_tag(tag):
        log.warning("checkpoint pointer '%s' does not hold a checkpoint tag; ignoring it", path)
        return None
    return tag


def write_latest(root: Path, tag: str) -> None:
    """Point ``latest`` at ``tag`` atomically."""
    replace_durably(root / LATEST, f"{tag}\n".encode())


def is_complete(root: Path, tag: str) -> bool:
    return is_valid_tag(tag) and (root / tag / MANIFEST).is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, float, str]]:
    """(step, mtime, tag) of every complete checkpoint under ``root``, oldest first."""
    out: list[tuple[int, float, str]] = []
    if not root.is_dir():
        return out
    for d in root.iterdir():
        if not (d.is_dir() and is_complete(root, d.name)):
            continue
        try:
            step = int(read_json(d / MANIFEST, "checkpoint manifest").get("step", -1))
        except (CheckpointError, AttributeError, TypeError, ValueError):
            continue  # a damaged manifest: never chosen, never pruned
        out.append((step, (d / MANIFEST).stat().st_mtime, d.name))
    return sorted(out)


def resolve(root: Path, tag: str | None) -> str | None:
    """The tag to load: ``tag`` if given and complete; else what ``latest`` names if complete;
    else the newest complete checkpoint. None when there is none."""
    if tag is not None:
        check_tag(tag)
        return tag if is_complete(root, tag) else None
    pointed = read_latest(root)
    if pointed is not None and is_complete(root, pointed):
        return pointed
    found = complete_checkpoints(root)
    if not found:
        return None
    newest = found[-1][2]
    if pointed is not None:
        log.warning(
            "checkpoint pointer '%s' names %r, which is not a complete checkpoint; "
            "using the newest complete one, %r",
            root / LATEST,
            pointed,
            newest,
        )
    return newest


def prune(root: Path, keep_last: int, protect: str) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (never ``protect``), and any
    leftovers of interrupted saves. Returns the tags deleted."""
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(d, ignore_errors=True)
    if keep_last <= 0:
        return []
    found = [t for _, _, t in complete_checkpoints(root)]
    doomed = [t for t in found[: max(0, len(found) - keep_last)] if t != protect]
    for t in doomed:
        # Renamed out of the way first, so a crash mid-delete leaves no half checkpoint that
        # still looks complete.
        gone = root / f"{OLD_PREFIX}{t}-pruned"
        (root / t).rename(gone)
        shutil.rmtree(gone, ignore_errors=True)
    return doomed
