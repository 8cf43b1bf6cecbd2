"""Activation checkpointing by config: chosen modules keep only their inputs during the forward
and run again in the backward to rebuild what it needs (``torch.utils.checkpoint``,
non-reentrant), trading compute for activation memory, under every strategy and schedule.

``[activation_checkpointing] classes = ["Block"]`` checkpoints every module of those classes
(``every = k``: every k-th of them, in model order), not the modules inside one already chosen.
The module keeps its parameters and names; only its ``forward`` is wrapped, and only while
gradients are on (evaluation under ``no_grad`` runs it plainly). A module that holds BatchNorm
is refused: the recomputation would update its running statistics a second time.

[Note: cpu checkpointing] ``cpu_checkpointing = true`` (DeepSpeed's
``activation_checkpointing.cpu_checkpointing``) keeps what a recomputed module holds between its
forward and its backward, its inputs, in CPU memory: the checkpoint runs under
``torch.autograd.graph.save_on_cpu``, whose hooks see exactly the tensors the checkpoint saves
for its recomputation (the ops inside save nothing, being recomputed), so the inputs are copied
to CPU (pinned on CUDA) after the forward and back to the device when the backward recomputes
the module. The values are the same, only where they wait changes. On a CPU device they are in
CPU memory already: the key is accepted with one log line saying it has no effect.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

from longboat.config.errors import ConfigError
from longboat.config.sections import ActivationCheckpointingConfig

log = logging.getLogger("longboat")


def apply_activation_checkpointing(
    model: nn.Module, cfg: ActivationCheckpointingConfig, device: torch.device | None = None
) -> int:
    """Wrap the forward of the modules ``cfg`` names; returns how many. Call it before a
    strategy installs its hooks (``initialize`` does); ``device``: where the model runs
    (default CPU), for ``cfg.cpu_checkpointing`` ([Note: cpu checkpointing])."""
    device = device or torch.device("cpu")
    offload = cfg.cpu_checkpointing and bool(cfg.classes) and device.type != "cpu"
    if cfg.cpu_checkpointing and not cfg.classes:
        log.info(
            "activation_checkpointing.cpu_checkpointing has no effect: no module is recomputed "
            "(name them with activation_checkpointing.classes)"
        )
    elif cfg.cpu_checkpointing and not offload:
        log.info(
            "activation_checkpointing.cpu_checkpointing has no effect on a CPU device: the "
            "recomputed modules' inputs are in CPU memory already"
        )
    if not cfg.classes:
        return 0
    wanted = set(cfg.classes)
    matches = [(name, m) for name, m in model.named_modules() if type(m).__name__ in wanted]
    if not matches:
        have = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"key 'activation_checkpointing.classes' = {cfg.classes}: the model (on this rank) "
            f"has no module of these classes; it has {have}"
        )
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in matches[:: cfg.every]:
        if any(name.startswith(f"{c}.") for c, _ in chosen):
            continue  # inside a module already recomputed as a whole
        if any(isinstance(sub, nn.modules.batchnorm._BatchNorm) for sub in m.modules()):
            raise ConfigError(
                f"key 'activation_checkpointing.classes': {name or 'the model'} "
                f"({type(m).__name__}) holds BatchNorm, whose running statistics the "
                "recomputation would update twice; choose modules without it"
            )
        _wrap(m, offload, pin=device.type == "cuda")
        chosen.append((name, m))
    log.info(
        "activation checkpointing: %d module(s) of %s recomputed in backward%s",
        len(chosen),
        ", ".join(sorted(wanted)),
        ", their inputs kept in CPU memory" if offload else "",
    )
    return len(chosen)


def _wrap(module: nn.Module, offload: bool, pin: bool) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if offload:  # [Note: cpu checkpointing]
            with save_on_cpu(pin_memory=pin):
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed
