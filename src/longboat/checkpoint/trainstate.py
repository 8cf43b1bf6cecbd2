"""The engine's own state in a checkpoint (``state.json``), as JSON: step counters, the optimizer's
param groups (hyper-parameters and which parameters each holds), the LR scheduler, the loaders'
positions, the fp16 loss scaler, and the user's ``client_state``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from longboat.checkpoint.errors import CheckpointError
from longboat.pieces import decode_scalar, encode_scalar

if TYPE_CHECKING:
    from longboat.checkpoint.protocol import Trained

log = logging.getLogger("longboat")

# Engine counters a checkpoint carries (those the engine has).
COUNTERS = ("global_step", "micro_step", "skipped_steps")


def _scaler(engine: Trained) -> Any:
    return getattr(getattr(engine, "precision", None), "scaler", None)


def capture(engine: Trained, groups: list[list[str]], client_state: Any) -> dict[str, Any]:
    """Everything of ``state.json``; ``groups`` are the parameter names per optimizer group."""
    cpu = torch.device("cpu")
    hyper = [
        {
            k: _encode(v, f"optimizer param_groups[{i}][{k!r}]", cpu)
            for k, v in g.items()
            if k != "params"
        }
        for i, g in enumerate(engine.optimizer.param_groups)
    ]
    scaler = _scaler(engine)
    return {
        "counters": {k: int(getattr(engine, k)) for k in COUNTERS if hasattr(engine, k)},
        "optimizer": {
            "groups": [
                {"params": names, "hyper": h} for names, h in zip(groups, hyper, strict=True)
            ]
        },
        "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "loaders": engine.checkpointing.loader_states(),
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "client_state": client_state,
    }


def _encode(value: Any, where: str, device: torch.device) -> Any:
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]", device) for i, v in enumerate(value)]
    if isinstance(value, str):
        return value
    return encode_scalar(value, where, device)


def check_groups(saved: dict[str, Any], current: list[list[str]]) -> None:
    """Refuse (before anything is loaded) optimizer groups that do not match the checkpoint's:
    a different number of groups, or a parameter that changed group."""
    groups = saved["optimizer"]["groups"]
    if len(groups) != len(current):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} param group(s), this "
            f"one has {len(current)}: build the optimizer with the same groups"
        )
    then = {n: i for i, g in enumerate(groups) for n in g["params"]}
    moved = [
        f"{n!r} (group {then[n]} -> {i})"
        for i, names in enumerate(current)
        for n in names
        if n in then and then[n] != i
    ]
    if moved:
        raise CheckpointError(
            f"parameters changed optimizer group since the checkpoint: "
            f"{', '.join(moved[:5])}; build the optimizer with the same groups"
        )


def check_scheduler(saved: dict[str, Any], engine: Trained) -> None:
    """Refuse (before anything is loaded) a scheduler state with no scheduler to take it, and
    say when a scheduler will start afresh."""
    if saved["scheduler"] is not None and engine.scheduler is None:
        raise CheckpointError(
            "the checkpoint holds an LR scheduler's state but this engine has "
            "no scheduler: pass the same scheduler to initialize() (or set the "
            "config's 'scheduler' section)"
        )
    if saved["scheduler"] is None and engine.scheduler is not None:
        log.warning("the checkpoint holds no LR scheduler state: the scheduler starts afresh")


def check_loaders(saved: dict[str, Any], engine: Trained) -> None:
    """Refuse (before anything is loaded) loader positions this engine's batch cannot resume:
    the samples an epoch had consumed must be whole micro-batches over all ranks here."""
    per_batch = engine.batch.micro_batch_size * engine.comm.world_size
    for i, st in enumerate(saved["loaders"]):
        if int(st["samples"]) % per_batch:
            raise CheckpointError(
                f"loader {i} stood {st['samples']} samples into epoch {st['epoch']}, which is "
                f"not a whole number of micro-batches of {engine.batch.micro_batch_size} x "
                f"{engine.comm.world_size} ranks: resume with the global batch it was saved "
                "with (batch.train_batch_size)"
            )


def apply(engine: Trained, saved: dict[str, Any]) -> None:
    """Put back everything of ``state.json`` except the client state."""
    for group, g in zip(engine.optimizer.param_groups, saved["optimizer"]["groups"], strict=True):
        for k, v in g["hyper"].items():
            group[k] = _decode_like(v, group.get(k))
    if saved["scheduler"] is not None and engine.scheduler is not None:
        engine.scheduler.load_state_dict(saved["scheduler"])
    engine.checkpointing.load_loader_states(saved["loaders"])
    for k, v in saved["counters"].items():
        if k in COUNTERS and hasattr(engine, k):
            setattr(engine, k, int(v))
    scaler = _scaler(engine)
    if scaler is not None and saved.get("loss_scaler") is not None:
        scaler.load_state_dict(saved["loss_scaler"])
    elif scaler is not None:
        log.warning(
            "the checkpoint has no fp16 loss scale (it was not trained in fp16): the "
            "loss scale starts at its initial value"
        )


def _decode_like(value: Any, current: Any) -> Any:
    """A saved hyper-parameter in the type the optimizer holds now (tuple, tensor, number)."""
    if isinstance(value, list):
        items = [_decode_like(v, None) for v in value]
        return tuple(items) if isinstance(current, tuple) else items
    out = decode_scalar(value, torch.device("cpu"))
    if isinstance(current, torch.Tensor):
        current.fill_(out.item() if isinstance(out, torch.Tensor) else out)
        return current
    return out
