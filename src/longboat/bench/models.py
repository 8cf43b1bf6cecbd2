"""What ``longboat bench`` trains: built-in models, or the user's own by import path.

The contract for a user's model (``--model pkg.mod:factory``): ``factory()`` takes no
arguments and returns a :class:`ModelSpec`. The bench calls ``spec.build()`` once per side, each
time after seeding torch identically, so every side starts from the same weights; it calls
``spec.batch(n, generator)`` for a *global* batch of ``n`` samples and gives rank ``r`` the
``r``-th equal slice of every tensor along dimension 0 (the last tensor is the target), so all
sides, and under strong scaling all world sizes, see the same samples; and it trains with
``spec.loss(model(*inputs), target)`` and AdamW.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from longboat.models import GPT, DigitsCNN, gpt_loss, reference_gpt, synthetic_tokens

Batch = tuple[torch.Tensor, ...]


def share_of(batch: Batch, rank: int, n: int) -> Batch:
    """Data-parallel rank ``rank``'s share of ``batch``: the ``rank``-th of ``n`` equal slices of
    dim 0."""
    m = batch[0].shape[0] // n
    return tuple(t[rank * m : (rank + 1) * m] for t in batch)


@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark and how to feed it.

    Attributes:
        name: shown in the report.
        build: returns a fresh model (called after ``torch.manual_seed``).
        batch: ``batch(n, generator)`` returns ``n`` samples: input tensors, then the target.
        loss: ``loss(output, target)``, a scalar.
        unit_classes: class names of the blocks that ZeRO-3 and FSDP2 shard one at a time
            (empty: the whole model is one unit).
        info: free-form facts for the report (sizes, sequence length).
    """

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, torch.Generator], Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    unit_classes: tuple[str, ...] = ()
    info: dict[str, object] = field(default_factory=dict)


def _gpt_spec(name: str, make: Callable[[], GPT], seq_len: int) -> ModelSpec:
    probe = make()
    if seq_len > probe.seq_len:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's {probe.seq_len}: use {probe.seq_len} or less"
        )
    vocab = probe.vocab_size
    info: dict[str, object] = {
        "vocab_size": vocab,
        "d_model": probe.d_model,
        "n_layers": probe.n_layers,
        "n_heads": probe.n_heads,
        "seq_len": seq_len,
        "parameters": sum(p.numel() for p in probe.parameters()),
    }
    return ModelSpec(
        name=name,
        build=make,
        batch=lambda n, g: synthetic_tokens(n, seq_len, vocab, g),
        loss=gpt_loss,
        unit_classes=("_Block",),
        info=info,
    )


def reference_gpt_spec(seq_len: int = 128) -> ModelSpec:
    """The reference GPT (21,064,704 parameters) on synthetic tokens."""
    return _gpt_spec("reference-gpt", reference_gpt, seq_len)


def tiny_gpt_spec(seq_len: int = 16) -> ModelSpec:
    """A 2-layer, d_model 32 GPT: the same code path as the reference, for tests."""
    return _gpt_spec(
        "tiny-gpt",
        lambda: GPT(
            vocab_size=128, d_model=32, n_layers=2, n_heads=2, seq_len=32, tie_weights=False
        ),
        seq_len,
    )


def _digits_batch(n: int, g: torch.Generator) -> Batch:
    # Random 8x8 images and labels: step time does not depend on the pixels.
    return torch.rand(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def digits_cnn_spec() -> ModelSpec:
    """:class:`~longboat.models.DigitsCNN` (38,282 parameters) on random 8x8 images."""
    return ModelSpec(
        name="digits-cnn",
        build=DigitsCNN,
        batch=_digits_batch,
        loss=F.cross_entropy,
        info={"parameters": 38_282, "input": "1x8x8"},
    )


BUILTIN = ("reference-gpt", "digits-cnn", "tiny-gpt")


def resolve_model(name: str, seq_len: int = 128) -> ModelSpec:
    """The spec for ``name``: a built-in (:data:`BUILTIN`) or ``pkg.mod:factory``.

    Raises:
        ValueError: the name is neither, or the factory does not return a :class:`ModelSpec`;
            the message says what to give instead.
    """
    if name == "reference-gpt":
        return reference_gpt_spec(seq_len)
    if name == "tiny-gpt":
        return tiny_gpt_spec(seq_len)
    if name == "digits-cnn":
        return digits_cnn_spec()
    if ":" not in name:
        raise ValueError(
            f"--model {name!r} is unknown: give one of {list(BUILTIN)} or "
            "'pkg.module:factory' returning a longboat.bench.ModelSpec"
        )
    mod_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"--model {name!r} cannot be loaded ({type(e).__name__}: {e}): "
            "check that the module is importable (PYTHONPATH) and defines the "
            "factory"
        ) from e
    spec = factory()
    if not isinstance(spec, ModelSpec):
        raise ValueError(
            f"--model {name!r} returned {type(spec).__name__}, not a "
            "longboat.bench.ModelSpec: see the contract in longboat.bench.models"
        )
    return spec
