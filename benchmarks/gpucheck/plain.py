"""The plain PyTorch loops the GPU check compares longboat with, on any device.

Like ``tests/reference.py`` (whose models, data and recipes these loops use), this module imports
nothing from longboat; ``tests/test_gpu_check.py`` parses its imports to keep it so. The models
it trains are handed in or built by ``reference``, never wrapped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

# tests/reference.py is a plain module beside the tests, not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import reference

Order = Sequence[Sequence[Sequence[Sequence[int]]]]  # [step][micro-batch][rank] -> sample ids


def train_in_rank_order(
    recipe: reference.Recipe, data: TensorDataset, order: Order, device: str
) -> dict[str, Any]:
    """``reference.plain_train`` (fp32) on ``device``: for each step, each micro-batch and each
    rank in turn, forward that rank's samples and backward ``loss / (accumulation x ranks)``,
    then clip, step the optimizer and the scheduler. Every rank's forward of a micro-batch
    starts from the same buffers, and afterwards the buffers are rank 0's (DDP's convention).

    Returns the losses ``[step][micro-batch][rank]`` and the final ``state_dict`` on the CPU.
    """
    model, opt, sched = recipe.build()  # on the CPU, as longboat is given it
    model.to(device)  # the parameters stay the objects the optimizer holds
    data = TensorDataset(*(t.to(device) for t in data.tensors))
    accum, ranks = len(order[0]), len(order[0][0])
    losses: list[list[list[float]]] = []
    for step in order:
        opt.zero_grad(set_to_none=True)
        step_losses = []
        for micro in step:
            before = _buffers(model)
            after_first: dict[str, torch.Tensor] | None = None
            micro_losses = []
            for ids in micro:
                if after_first is not None:
                    _set_buffers(model, before)
                _, *batch = data[list(ids)]  # (sample ids, inputs..., targets)
                loss = reference.forward_loss(model, batch)
                (loss / (accum * ranks)).backward()
                micro_losses.append(float(loss.detach()))
                if after_first is None:
                    after_first = _buffers(model)
            if after_first is not None:
                _set_buffers(model, after_first)
            step_losses.append(micro_losses)
        losses.append(step_losses)
        if recipe.clip > 0:
            params = [p for p in model.parameters() if p.requires_grad]
            torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        opt.step()
        if sched is not None:
            sched.step()
    return {"losses": losses, "state": _cpu_state(model)}


def train_micro_batches(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    micro: int,
    clip: float,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: str,
) -> dict[str, Any]:
    """One process over whole batches ``(x, y)``: each in micro-batches of ``micro``, backward
    ``loss / micro-batches``, clip at ``clip``, step. Returns each step's mean loss and the
    final ``state_dict`` on the CPU."""
    model.to(device)
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        total, n = 0.0, x.shape[0] // micro
        for xm, ym in zip(x.split(micro), y.split(micro), strict=True):
            loss = loss_fn(model(xm.to(device)), ym.to(device))
            (loss / n).backward()
            total += float(loss.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total / n)
    return {"losses": losses, "state": _cpu_state(model)}


def step_fn(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dtype: torch.dtype | None,
    read_loss: bool = False,
) -> Callable[[], None]:
    """One training step of a plain script, as a function: forward under ``torch.autocast``
    to ``dtype`` (none when None), the loss in fp32, backward, ``opt.step()``, ``zero_grad``.
    ``read_loss``: copy the loss to the host each step, as a script that prints it does."""
    x, y = batch
    device_type = x.device.type

    def step() -> None:
        with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
        loss = loss_fn(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if read_loss:
            float(loss.detach())

    return step


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


def _set_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(values[n])


def _cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
