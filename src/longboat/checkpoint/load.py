"""Verified, resharding loads.

[Note: verified load] Nothing of the engine is touched until the whole checkpoint is proven
intact and meant for this model: the manifest's own checksum and structure, the model fingerprint,
the optimizer's param groups, and the size and SHA-256 of every file (the files are split among
the ranks so each is hashed once). Every rank's verdict is shared, so all ranks refuse together,
naming the file, tensor or parameter, or all go on to load. Then the strategy fills its own
slices from whatever shards the checkpoint has (see [Note: pieces]), and the engine's counters,
optimizer groups, scheduler, loaders, loss scaler and RNG states follow.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longboat.checkpoint import layout, rng, trainstate
from longboat.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from longboat.checkpoint.exchange import gather_json
from longboat.checkpoint.fsio import read_json
from longboat.checkpoint.manifest import Manifest, read_manifest
from longboat.checkpoint.source import ManifestSource
from longboat.checkpoint.verify import verify_files

if TYPE_CHECKING:
    from longboat.checkpoint.protocol import Trained

log = logging.getLogger("longboat")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load` loaded."""

    path: Path
    tag: str
    step: int
    strategy: str  # the strategy that wrote it
    world_size: int  # the world size that wrote it
    client_state: Any  # what was passed to save_checkpoint as client_state
    resharded_from: str | None = None  # "strategy x world size" when not the current layout

    @property
    def resharded(self) -> bool:
        """True when it was written at another world size or by another strategy."""
        return self.resharded_from is not None


def load(
    engine: Trained,
    directory: str | os.PathLike[str],
    tag: str | None = None,
    *,
    allow_missing: bool = False,
) -> LoadedCheckpoint | None:
    """Load a checkpoint into ``engine`` (see [Note: verified load]); every rank must call it.

    ``tag=None`` loads the one ``latest`` names (or, if that is damaged or missing, the newest
    complete one). With ``allow_missing=True`` a directory with no checkpoint returns None (a
    fresh start); otherwise it is an error.
    """
    comm = engine.control
    root = Path(directory)
    if engine.micro_step % engine.accumulation_steps:
        raise CheckpointError(
            f"load_checkpoint at micro-step {engine.micro_step}, between accumulation boundaries:"
            " the accumulated gradients would not match the loaded weights; load before training"
            " or right after engine.step() returns True"
        )
    try:
        found: tuple[str | None, str | None] = (layout.resolve(root, tag), None)
    except CheckpointError as e:
        found = (None, str(e))
    # Rank 0's answer is everyone's: all ranks load the same checkpoint.
    chosen, problem = gather_json(comm, found)[0]
    if problem:
        raise CheckpointError(problem)
    if chosen is None:
        if allow_missing:
            log.info("no checkpoint in %s; starting fresh", root)
            return None
        what = f"checkpoint {tag!r}" if tag else "a complete checkpoint"
        raise CheckpointNotFoundError(
            f"'{root}' holds no {what} (none named by '{layout.LATEST}', no directory with a "
            f"{layout.MANIFEST}); check the path, or pass allow_missing=True to start fresh when "
            "there is none"
        )
    path = root / chosen

    manifest, saved, error = None, None, None
    try:
        manifest = read_manifest(path / layout.MANIFEST)
        _check_model(engine, manifest, path)
        verify_files(path, manifest, comm.rank, comm.world_size)
        saved = read_json(path / layout.STATE, "checkpoint state")
        current = engine.strategy.checkpoint_state(engine.model, engine.optimizer).groups
        trainstate.check_groups(saved, current)
        trainstate.check_loaders(saved, engine)
        trainstate.check_scheduler(saved, engine)
    except CheckpointError as e:
        error = str(e)
    verdicts = gather_json(comm, error)
    if any(verdicts):
        raise CheckpointError(_combine(verdicts))
    assert manifest is not None and saved is not None

    scalars: dict[str, dict[str, Any]] = {}
    for r in range(manifest.world_size):
        per_rank = read_json(path / layout.rank_file(r), "checkpoint rank state")
        for name, sc in per_rank["optimizer_scalars"].items():
            scalars.setdefault(name, sc)
        if r == (comm.rank if comm.rank < manifest.world_size else 0):
            own_rng = per_rank["rng"]
    source = ManifestSource(path, manifest, scalars)
    try:
        engine.strategy.load_checkpoint_state(engine.model, engine.optimizer, source)
    finally:
        source.close()
    trainstate.apply(engine, saved)
    rng.restore(own_rng)
    here = f"{engine.strategy.name} x {comm.world_size}"
    there = f"{manifest.strategy} x {manifest.world_size}"
    log.info(
        "checkpoint %r loaded from %s (step %d; written by %s%s)",
        manifest.tag,
        path,
        manifest.step,
        there,
        "" if there == here else f", resharded to {here}",
    )
    return LoadedCheckpoint(
        path,
        manifest.tag,
        manifest.step,
        manifest.strategy,
        manifest.world_size,
        saved.get("client_state"),
        None if there == here else there,
    )


def _check_model(engine: Trained, manifest: Manifest, path: Path) -> None:
    ours = engine.checkpointing.spec
    if manifest.fingerprint == ours.fingerprint:
        return
    lines = manifest.model.differences(ours)
    raise CheckpointError(
        f"checkpoint '{path}' is for another model (fingerprint {manifest.fingerprint[:12]}, "
        f"this model's {ours.fingerprint[:12]}):\n  "
        + "\n  ".join(lines)
        + "\nload it into the model it was saved from (same parameter names, shapes, dtypes and "
        "tied weights)"
    )


def _combine(verdicts: list[str | None]) -> str:
    """One message from every rank's verdict, identical ones merged."""
    if len(verdicts) == 1:
        return str(verdicts[0])
    by_msg: dict[str, list[int]] = {}
    for r, v in enumerate(verdicts):
        if v:
            by_msg.setdefault(v, []).append(r)
    if len(by_msg) == 1 and len(next(iter(by_msg.values()))) > 1:
        return next(iter(by_msg))
    return "\n".join(f"{m} (found by rank {', '.join(map(str, rs))})" for m, rs in by_msg.items())
