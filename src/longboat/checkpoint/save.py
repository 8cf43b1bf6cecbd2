"""Atomic, sharded saves.

[Note: atomic save] Every rank writes its files into one temporary directory inside the
checkpoint directory (``.tmp-<tag>-<nonce>``), each flushed and fsync'd. The ranks then exchange
what they wrote (file checksums and the slice index, as JSON) and whether they succeeded.
Only when every rank succeeded does rank 0 write the manifest (last, fsync'd), rename the
temporary directory to the tag (an atomic rename within one directory) and finally move
``latest`` (write-temp-then-rename). A crash at any moment therefore leaves either a directory
that is ignored (a ``.tmp-`` one, or a complete one ``latest`` does not name yet) and the
previous checkpoint still named by ``latest``, or the new checkpoint complete and named. Any
rank's failure becomes an error on every rank, naming the rank, instead of a hang.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longboat.checkpoint import layout, rng, trainstate
from longboat.checkpoint.errors import CheckpointError
from longboat.checkpoint.exchange import gather_json
from longboat.checkpoint.fingerprint import dtype_name
from longboat.checkpoint.fsio import fsync_dir, to_json_bytes
from longboat.checkpoint.manifest import Manifest, Shard, TensorEntry
from longboat.checkpoint.tensorfile import write_json, write_tensors
from longboat.pieces import Piece, Slices

if TYPE_CHECKING:
    from longboat.checkpoint.protocol import Trained

log = logging.getLogger("longboat")

#: Where a save stands; ``on_phase`` is called with each (for fault-injection tests).
#: ``files_written``: every rank's files are in the temporary directory (no manifest yet).
#: ``manifest_written``: the manifest is in the temporary directory, not yet renamed.
#: ``renamed``: the checkpoint is in place under its tag; ``latest`` not yet moved.
#: ``latest_moved``: ``latest`` names it; older checkpoints not yet pruned.
PHASES = ("files_written", "manifest_written", "renamed", "latest_moved")


def _key(p: Piece) -> str:
    return f"{p.key}:{p.name}"


def _where(p: Piece) -> tuple[str, str, int, str]:
    """A piece's place in its full tensor: name, key, start and its slices (two tensor-parallel
    ranks hold different pieces that start at 0)."""
    return (p.name, p.key, p.start, repr(p.slices))


def assign_replicated(pieces: list[Piece]) -> dict[tuple[str, str, int, str], int]:
    """Which global rank writes each replicated piece, keyed by :func:`_where`: among the
    ranks that hold it, largest first to the least loaded, so each tensor is written once and
    the bytes spread evenly. Every holder computes the same answer from the same pieces."""
    by_holders: dict[tuple[int, ...], list[Piece]] = {}
    for p in pieces:
        if p.replicated:
            by_holders.setdefault(p.replicas, []).append(p)
    owner = {}
    for holders, group in by_holders.items():
        order = sorted(
            group,
            key=lambda p: (-p.tensor.numel() * p.tensor.element_size(), p.name, p.key, p.start),
        )
        load = [0] * len(holders)
        for p in order:
            i = min(range(len(holders)), key=lambda i: (load[i], i))
            owner[_where(p)] = holders[i]
            load[i] += p.tensor.numel() * p.tensor.element_size()
    return owner


def save(
    engine: Trained,
    directory: str | os.PathLike[str],
    tag: str | None = None,
    client_state: Any = None,
    *,
    on_phase: Callable[[str], None] | None = None,
) -> Path:
    """Write a checkpoint of ``engine`` under ``directory/tag`` (see [Note: atomic save]).

    Every rank must call it, with the same tag. Returns the checkpoint's path.
    """
    comm, rank = engine.control, engine.control.rank
    phase = on_phase or (lambda _name: None)
    if engine.micro_step % engine.accumulation_steps:
        raise CheckpointError(
            f"save_checkpoint at micro-step {engine.micro_step}, between accumulation boundaries"
            f" (every {engine.accumulation_steps}): the gradients accumulated so far would be "
            "lost; save right after engine.step() returns True"
        )
    tag = str(tag) if tag is not None else layout.default_tag(engine.global_step)
    agreed = gather_json(comm, (tag, uuid.uuid4().hex[:12]))
    tags = [t for t, _ in agreed]
    if len(set(tags)) > 1:
        ranks = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        raise CheckpointError(
            f"ranks disagree on the checkpoint tag ({ranks}); pass the same "
            "tag on every rank, or none (the step number is used)"
        )
    layout.check_tag(tag)
    root = Path(directory)
    tmp = root / f"{layout.TMP_PREFIX}{tag}-{agreed[0][1]}"

    error: BaseException | None = None
    report: dict[str, Any] | None = None
    try:
        report = _write_rank_files(engine, tmp, client_state)
    except Exception as e:  # shared with the other ranks below, so that none hangs
        error = e
    phase("files_written")
    reports = gather_json(comm, (f"{type(error).__name__}: {error}" if error else None, report))
    failed = {r: msg for r, (msg, _) in enumerate(reports) if msg}
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        what = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise CheckpointError(
            f"checkpoint {tag!r} was not saved ({what}); the previous checkpoint is untouched"
        ) from error

    outcome = None
    if rank == 0:
        try:
            _publish(engine, root, tmp, tag, [r for _, r in reports], phase)
        except Exception as e:
            error, outcome = e, f"{type(e).__name__}: {e}"
    else:
        for name in PHASES[1:]:  # the other ranks pass rank 0's phases while they wait for it
            phase(name)
    outcomes = gather_json(comm, outcome)
    if outcomes[0]:
        raise CheckpointError(
            f"checkpoint {tag!r} was not published by rank 0 "
            f"({outcomes[0]}); the previous checkpoint is untouched"
        ) from error
    log.info("checkpoint %r saved to %s (step %d)", tag, root / tag, engine.global_step)
    return root / tag


def _write_rank_files(engine: Trained, tmp: Path, client_state: Any) -> dict[str, Any]:
    """This rank's tensor file and JSON file (and rank 0's state.json); what they hold."""
    comm = engine.control  # the world: one tensor file and one JSON file per rank
    tmp.mkdir(parents=True, exist_ok=True)
    state = engine.strategy.checkpoint_state(engine.model, engine.optimizer)
    # [Note: tied weights] in pipeline/tied.py: a weight on several stages is written once
    engine.schedule.ties.write_once(state.pieces, engine.topology.mesh, engine.topology.rank)
    owner = assign_replicated(state.pieces)
    mine = [p for p in state.pieces if not p.replicated or owner[_where(p)] == comm.rank]
    tfile = layout.tensor_file(comm.rank)
    record = write_tensors(
        tmp / tfile,
        [(_key(p), p.tensor) for p in mine],
        {"format": "longboat-checkpoint", "rank": str(comm.rank)},
    )
    files = {tfile: record}
    index = [
        [
            p.name,
            p.key,
            list(p.shape),
            dtype_name(p.tensor.dtype),
            p.start,
            p.end,
            tfile,
            _key(p),
            record.tensors[_key(p)],
            None if p.slices is None else p.slices.to_json(),
        ]
        for p in mine
    ]
    per_rank = {"rank": comm.rank, "rng": rng.capture(), "optimizer_scalars": state.scalars}
    rfile = layout.rank_file(comm.rank)
    files[rfile] = write_json(tmp / rfile, to_json_bytes(per_rank, f"rank {comm.rank} state"))
    if comm.rank == 0:
        saved = trainstate.capture(engine, state.groups, client_state)
        files[layout.STATE] = write_json(tmp / layout.STATE, to_json_bytes(saved, "state"))
    return {
        "files": {f: {"sha256": r.sha256, "bytes": r.bytes} for f, r in files.items()},
        "index": index,
    }


def _publish(
    engine: Trained,
    root: Path,
    tmp: Path,
    tag: str,
    reports: list[dict[str, Any]],
    phase: Callable[[str], None],
) -> None:
    """Rank 0: manifest, rename into place, move ``latest``, prune (see [Note: atomic save])."""
    tensors: dict[str, dict[str, TensorEntry]] = {}
    files: dict[str, dict[str, Any]] = {}
    for rep in reports:
        files.update(rep["files"])
        for name, key, shape, dtype, start, end, file, fkey, sha, sliced in rep["index"]:
            e = tensors.setdefault(name, {}).get(key)
            slices = None if sliced is None else Slices.from_json(sliced)
            shard = Shard(file, fkey, start, end, sha, slices)
            tensors[name][key] = TensorEntry(tuple(shape), dtype, (*(e.shards if e else ()), shard))
    spec = engine.checkpointing.spec
    manifest = Manifest(
        tag,
        engine.global_step,
        engine.strategy.name,
        engine.control.world_size,
        spec,
        spec.fingerprint,
        tensors,
        files,
        time.time(),
    )
    write_json(tmp / layout.MANIFEST, to_json_bytes(manifest.to_json(), "manifest"))
    fsync_dir(tmp)
    phase("manifest_written")
    final = root / tag
    if final.exists():  # same tag again: move the old one aside first (ignored if we crash)
        final.rename(root / f"{layout.OLD_PREFIX}{tag}-{uuid.uuid4().hex[:8]}")
    tmp.rename(final)
    fsync_dir(root)
    phase("renamed")
    layout.write_latest(root, tag)
    phase("latest_moved")
    keep = engine.config.checkpoint.keep_last
    pruned = layout.prune(root, keep, protect=tag)
    if pruned:
        log.info("checkpoint.keep_last = %d: removed %s", keep, ", ".join(pruned))
