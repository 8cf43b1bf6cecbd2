"""Each layer's measured cost, for the ``measured`` partition: forward and backward seconds and
the bytes autograd saves for the backward, timed on one process before the model is split.

[Note: measuring leaves the model as it was] The profile runs real forwards and backwards of
the user's layers, before the first step, and the run that follows must still equal a plain
PyTorch loop. So it keeps what a forward or backward may change: torch's random number
generators (dropout draws from them; the data order and the first step's dropout must be the
ones plain PyTorch sees) are saved and restored; every buffer is copied and written back (a
BatchNorm in training mode updates its running statistics and counter on each forward); every
parameter's ``.grad`` is set aside and put back (the profile's backwards accumulate into fresh
tensors that are then dropped). Parameters are only read. Layer specs are built one at a time
for the profile and dropped after it; their initialisation draws random numbers too, which the
restored generators undo.

[Note: the loss in the profile] The last stage computes the loss too, forward and backward,
but the loss function is not known before the first step (it is ``train_step``'s argument).
Left out, the last stage looked cheaper than it was: on the reference GPT (vocabulary 8192) its
forward and backward of one micro-batch took 1.12-1.18x the profile's in training against
0.93-1.08x for the other stages (``benchmarks/results/pipeline_actions.json``), the cross
entropy over the logits being the difference. So the last piece's output, where it is a
floating tensor of at least two dimensions, is also timed through a cross entropy over its
last dimension (the loss of language models and classifiers, the pipelines' users), added to
the last piece's forward and backward; a loss of another kind costs what it costs, and
``pipeline.partition`` can place the boundaries by hand.

[Note: one measurement for every rank] Timings differ between processes, so ranks that each
timed their own layers could choose different boundaries and the pipeline would not fit
together. Only world rank 0 measures; :func:`agree` broadcasts its numbers over the control
plane, and every rank derives the boundaries from the same numbers by the same arithmetic.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longboat.comm.protocol import Comm

Layer = Callable[[Any], Any]

#: timed repetitions per layer (the least is kept) after one untimed warm-up
REPEATS = 3


@dataclass(frozen=True)
class LayerCosts:
    """Per layer: forward and backward seconds, and the bytes saved for its backward."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_bytes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.forward_s)

    @property
    def total_s(self) -> list[float]:
        """Forward plus backward seconds per layer: what the partition balances."""
        return [f + b for f, b in zip(self.forward_s, self.backward_s, strict=True)]

    def stage_sums(self, bounds: Sequence[int]) -> tuple[list[float], list[float]]:
        """Forward and backward seconds of each stage ``bounds`` delimits."""
        ranges = [range(bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]
        return (
            [sum(self.forward_s[i] for i in r) for r in ranges],
            [sum(self.backward_s[i] for i in r) for r in ranges],
        )

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor(
            [self.forward_s, self.backward_s, [float(b) for b in self.activation_bytes]],
            dtype=torch.float64,
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> LayerCosts:
        rows = t.tolist()
        return cls(tuple(rows[0]), tuple(rows[1]), tuple(int(b) for b in rows[2]))


def measure(
    layers: Iterable[Layer],
    example: Any,
    model: nn.Module,
    repeats: int = REPEATS,
) -> LayerCosts:
    """Time each of ``layers`` (run in order from ``example``, the model's inputs for one
    micro-batch) forward and backward, ``repeats`` times after a warm-up, keeping the least.
    ``model`` holds the layers' parameters and buffers, left as they were ([Note: measuring
    leaves the model as it was])."""
    fwd: list[float] = []
    bwd: list[float] = []
    saved: list[int] = []
    with _untouched(model), torch.enable_grad():
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        x = example[0] if isinstance(example, tuple) and len(example) == 1 else example
        for layer in layers:
            f, b, nbytes, out = _least(layer, x, own, repeats)
            fwd.append(f)
            bwd.append(b)
            saved.append(nbytes)
            x = _detached(out)
        if fwd and _has_classes(x):
            target = torch.zeros(x.shape[:-1].numel(), dtype=torch.long, device=x.device)

            def loss(t: torch.Tensor) -> torch.Tensor:
                # in fp32, as the engine hands a stage's floating outputs to the loss
                return F.cross_entropy(t.float().reshape(-1, t.shape[-1]), target)

            loss_f, loss_b, _, _ = _least(loss, x, own, repeats)
            fwd[-1] += loss_f
            bwd[-1] += loss_b
    return LayerCosts(tuple(fwd), tuple(bwd), tuple(saved))


def _has_classes(x: Any) -> bool:
    """Whether ``x`` can be a loss's input over classes ([Note: the loss in the profile])."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2


def _least(layer: Layer, x: Any, own: set[int], repeats: int) -> tuple[float, float, int, Any]:
    """:func:`_time_once` ``repeats`` times after a warm-up: the least forward and backward
    seconds, and the last run's saved bytes and output."""
    best_f = best_b = float("inf")
    nbytes, out = 0, None
    for rep in range(repeats + 1):
        f, b, nbytes, out = _time_once(layer, x, own)
        if rep:  # the first run warms caches and allocators up
            best_f, best_b = min(best_f, f), min(best_b, b)
    return best_f, best_b, nbytes, out


def _time_once(layer: Layer, x: Any, own: set[int]) -> tuple[float, float, int, Any]:
    """One forward and backward of ``layer`` on a fresh leaf copy of ``x``: seconds of each,
    bytes saved for the backward (the layer's own parameters not counted), and the output."""
    counted = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in own:
            counted[0] += t.numel() * t.element_size()
        return t

    inp = _leaf(x)
    _sync(inp)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(inp)
    _sync(out)
    t1 = time.perf_counter()
    roots = [t for t in _tensors(out) if t.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    _sync(out)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, counted[0], out


def agree(local: LayerCosts | None, layers: int, control: Comm) -> LayerCosts | None:
    """Rank 0's measurement on every rank of ``control`` ([Note: one measurement for every
    rank]); ``local`` is ignored on the other ranks. None on every rank when rank 0 has none
    (its measuring failed): the others then stop too rather than wait for it."""
    t = torch.full((3, layers), math.nan, dtype=torch.float64)
    if control.rank == 0 and local is not None:
        assert len(local) == layers, (len(local), layers)
        t = local.as_tensor()
    control.broadcast(t, src=0)
    return None if bool(t.isnan().any()) else LayerCosts.from_tensor(t)


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Restore, on exit, torch's RNG, ``model``'s buffers and its parameters' ``.grad``."""
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = (
        torch.cuda.get_rng_state_all()
        # torch.cuda.is_initialized is unannotated
        if torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        else None
    )
    buffers = [
        (mod, name, buf, buf.detach().clone())
        for mod in model.modules()
        for name, buf in mod._buffers.items()
        if buf is not None
    ]
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with torch.no_grad():
            for mod, name, buf, copy in buffers:
                buf.copy_(copy)
                mod._buffers[name] = buf  # the very tensor, in case a forward replaced it
        for p, g in grads:
            p.grad = g


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _detached(x: Any) -> Any:
    return _map(x, lambda t: t.detach())


def _leaf(x: Any) -> Any:
    """``x`` detached, its floating tensors requiring grad, as a later stage receives it."""
    return _map(
        x, lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t.detach()
    )


def _sync(x: Any) -> None:
    for t in _tensors(x):
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
            return
