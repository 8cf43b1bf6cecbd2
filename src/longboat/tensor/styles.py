"""How one module runs tensor-parallel: the styles a plan names.

=========================  =====================================================================
``colwise``                the output features are divided: weight rows (``nn.Linear``) or
                           columns (GPT-2's ``Conv1D``) and bias; the input is whole, the output
                           this rank's features. ``fused = 3`` for a q|k|v matrix ([Note:
                           tensor-parallel layouts] in ``layout.py``).
``colwise_gather_output``  ``colwise``, then the outputs gathered whole (an LM head, so that the
                           user's loss sees whole logits); its input is whole, also with
                           sequence parallelism (it comes after ``gather_sequence``).
``rowwise``                the input features are divided (a layer after a ``colwise`` one);
                           the partial outputs are summed, then the bias added. On an
                           ``nn.Embedding``: the vocabulary is divided (each rank looks up its
                           ids, the others give zeros) and the outputs summed.
``sequence``               a norm in the sequence-parallel part: it runs on this rank's part of
                           the sequence, its weights whole, their gradients summed over ranks.
``split_sequence``         where the sequence-parallel part begins: the module's input is cut
                           to this rank's part of the sequence.
``gather_sequence``        where it ends: the module's input is gathered whole (a final norm,
                           before the head and before a model reshapes its output by the
                           sequence length; or an attention block that reads the sequence
                           length from its input, whose q, k and v layers are then
                           ``{style = "colwise", input = "whole"}``).
``replicate``              left whole (the default for every module no pattern names).
=========================  =====================================================================

With ``sequence_parallel`` on, the activations between the tensor-parallel layers are divided
along the sequence: ``colwise`` gathers its input (the backward reduce-scatters), ``rowwise``
linear layers reduce-scatter their output instead of all-reducing it (and sum their bias's
gradient, added to a part of the sequence). Off, ``sequence``, ``split_sequence`` and
``gather_sequence`` do nothing. Each style replaces only the forward of the module it is given,
as an attribute of that one instance; the parameters keep their objects and names (their
``data`` becomes this rank's part), so optimizers, ties and state-dict keys stay the user's.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from longboat.comm.protocol import Comm
from longboat.tensor import regions
from longboat.tensor.layout import LayoutError, Split


@dataclass(frozen=True)
class Placement:
    """What a style may use: the ``tp`` doorway, the sequence-parallel switch, and ``shard``,
    which gives a parameter its layout (``shard(module, name, attribute, split)``)."""

    comm: Comm
    sequence_parallel: bool
    sequence_dim: int
    shard: Callable[[nn.Module, str, str, Split], None]


class Style(Protocol):
    """One way of running a module across the ``tp`` ranks."""

    def apply(self, module: nn.Module, name: str, at: Placement) -> None:
        """Divide ``module``'s parameters and replace its forward (``name``: for errors)."""
        ...


@dataclass(frozen=True)
class _Affine:
    """What the column and row styles need from a linear layer: which weight dimension is the
    output and which the input, and the product itself."""

    out_dim: int
    in_dim: int
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _conv1d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x @ w
    return y if b is None else y + b


def _affine(module: nn.Module, name: str, style: str) -> _Affine:
    if isinstance(module, nn.Linear):
        return _Affine(0, 1, F.linear)
    # Hugging Face's GPT-2 ``Conv1D``: a linear layer whose weight is stored [in, out]. Known
    # by its shape rather than imported, so transformers stays optional.
    # Read ``weight`` only once the class says Conv1D: any other module may have none.
    conv1d = type(module).__name__ == "Conv1D" and hasattr(module, "nf")
    weight = getattr(module, "weight", None) if conv1d else None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return _Affine(1, 0, _conv1d)
    raise LayoutError(
        f"tensor_parallel.plan: {name!r} is a {type(module).__name__}; {style!r} applies to "
        "nn.Linear (and transformers' Conv1D) layers: name the linear layers inside it"
    )


# A module's parameter, which nn.Module's attribute lookup types as a tensor or a module.
def _tensor(t: torch.Tensor | nn.Module) -> torch.Tensor:
    return cast(torch.Tensor, t)


def _optional(t: torch.Tensor | nn.Module | None) -> torch.Tensor | None:
    return cast("torch.Tensor | None", t)


def _sum_gradient_over(p: nn.Parameter, comm: Comm, tag: str) -> None:
    """Each rank saw its part of the sequence: ``p``'s gradient is the sum of theirs, made
    before the data-parallel strategy sees it (tensor hooks run before the gradient is
    accumulated, hence before a strategy's accumulation hooks)."""
    p.register_hook(lambda g: regions.reduce_from(g, comm, tag))  # type: ignore[no-untyped-call]


def _replace_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.forward = types.MethodType(forward, module)


@dataclass(frozen=True)
class Colwise:
    """See the module docstring; ``fused``: blocks stacked in the output (q|k|v: 3);
    ``whole_input``: the input is whole also with sequence parallelism (a ``gather_sequence``
    module around the layer gathered it once for several layers, as q, k and v)."""

    fused: int = 1
    gather_output: bool = False
    whole_input: bool = False

    def apply(self, module: nn.Module, name: str, at: Placement) -> None:
        style = "colwise_gather_output" if self.gather_output else "colwise"
        if self.gather_output and self.fused > 1:
            raise LayoutError(
                f"tensor_parallel.plan: {name!r}: {style} gathers outputs in rank order, which "
                "interleaves fused blocks; use colwise for a fused layer"
            )
        aff = _affine(module, name, style)
        at.shard(module, name, "weight", Split(aff.out_dim, self.fused))
        if getattr(module, "bias", None) is not None:
            at.shard(module, name, "bias", Split(0, self.fused))
        comm, dim = at.comm, at.sequence_dim
        gather_output = self.gather_output
        seq = at.sequence_parallel and not (gather_output or self.whole_input)

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if seq:
                x = regions.gather_scattered(x, comm, dim, name)
            else:
                x = regions.copy_to(x, comm, name)
            y = aff.run(x, _tensor(mod.weight), _optional(mod.bias))
            return regions.gather(y, comm, -1, name) if gather_output else y

        _replace_forward(module, forward)


@dataclass(frozen=True)
class Rowwise:
    """See the module docstring."""

    def apply(self, module: nn.Module, name: str, at: Placement) -> None:
        if isinstance(module, nn.Embedding):
            self._embedding(module, name, at)
            return
        aff = _affine(module, name, "rowwise")
        at.shard(module, name, "weight", Split(aff.in_dim))
        comm, seq, dim = at.comm, at.sequence_parallel, at.sequence_dim
        width = _tensor(module.weight).shape[aff.in_dim]
        bias = getattr(module, "bias", None)
        if seq and bias is not None and bias.requires_grad:
            # Added to this rank's part of the sequence only: its gradient is a part too.
            _sum_gradient_over(bias, comm, f"{name}.bias")

        def forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != width:
                raise LayoutError(
                    f"{name} is rowwise: its input should be this rank's {width} features "
                    f"(a colwise layer's output), not {x.shape[-1]}; make the layer before it "
                    "colwise, or this one replicate"
                )
            y = aff.run(x, _tensor(mod.weight), None)
            if seq:
                y = regions.reduce_scatter(y, comm, dim, name)
            else:
                y = regions.reduce_from(y, comm, name)
            # The bias is whole on every rank: added once, after the sum.
            bias = _optional(mod.bias)
            return y if bias is None else y + bias

        _replace_forward(module, forward)

    @staticmethod
    def _embedding(module: nn.Embedding, name: str, at: Placement) -> None:
        if module.max_norm is not None or module.sparse:
            raise LayoutError(
                f"tensor_parallel.plan: {name!r} is an nn.Embedding with max_norm or sparse "
                "gradients, which a vocabulary-parallel embedding does not support"
            )
        at.shard(module, name, "weight", Split(0))
        comm = at.comm
        rows = module.weight.shape[0]
        first = comm.rank * rows
        pad = module.padding_idx
        local_pad = pad - first if pad is not None and first <= pad < first + rows else None

        def forward(mod: nn.Module, ids: torch.Tensor) -> torch.Tensor:
            outside = (ids < first) | (ids >= first + rows)
            local = (ids - first).masked_fill(outside, 0)
            out = F.embedding(local, _tensor(mod.weight), local_pad)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
            # Whole on every rank (all-reduced, also with sequence parallelism): what follows an
            # embedding (a position embedding added, masks built from its shape) expects the
            # whole sequence; split_sequence starts the sequence-parallel part after it.
            return regions.reduce_from(out, comm, name)

        _replace_forward(module, forward)


@dataclass(frozen=True)
class Sequence:
    """See the module docstring."""

    def apply(self, module: nn.Module, name: str, at: Placement) -> None:
        if not at.sequence_parallel:
            return
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                _sum_gradient_over(p, at.comm, name)


def _first_input(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]]:
    """A module's input (positional, or Hugging Face's ``hidden_states``) and the rest."""
    if args:
        return args[0], args[1:], kwargs
    if "hidden_states" in kwargs:
        rest = dict(kwargs)
        return rest.pop("hidden_states"), (), rest
    raise LayoutError(f"{name} divides or gathers its input but was called without one")


@dataclass(frozen=True)
class SplitSequence:
    """See the module docstring."""

    def apply(self, module: nn.Module, name: str, at: Placement) -> None:
        if not at.sequence_parallel:
            return
        comm, dim = at.comm, at.sequence_dim

        def cut(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x, args, kwargs = _first_input(name, args, kwargs)
            if x.shape[dim] % comm.world_size:
                raise LayoutError(
                    f"sequence parallelism: {name}'s input has {x.shape[dim]} positions in "
                    f"dimension {dim}, which do not divide among tp = {comm.world_size} ranks; "
                    "use a sequence length divisible by tp"
                )
            return (regions.split(x, comm, dim, name), *args), kwargs

        module.register_forward_pre_hook(cut, with_kwargs=True)


@dataclass(frozen=True)
class GatherSequence:
    """See the module docstring."""

    def apply(self, module: nn.Module, name: str, at: Placement) -> None:
        if not at.sequence_parallel:
            return
        comm, dim = at.comm, at.sequence_dim

        def whole(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x, args, kwargs = _first_input(name, args, kwargs)
            # What follows is alike on every rank, so is the gradient coming back: each rank
            # keeps its chunk of it.
            return (regions.gather(x, comm, dim, name), *args), kwargs

        module.register_forward_pre_hook(whole, with_kwargs=True)


@dataclass(frozen=True)
class Replicate:
    """Whole on every rank: nothing to do."""

    def apply(self, module: nn.Module, name: str, at: Placement) -> None:
        return None


#: The styles a plan names, by name.
STYLES: dict[str, Style] = {
    "colwise": Colwise(),
    "colwise_gather_output": Colwise(gather_output=True),
    "rowwise": Rowwise(),
    "sequence": Sequence(),
    "split_sequence": SplitSequence(),
    "gather_sequence": GatherSequence(),
    "replicate": Replicate(),
}
