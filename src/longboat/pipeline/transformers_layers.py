"""Pipeline layers of Hugging Face transformers' causal language models: GPT-2 and the
Llama-shaped families (Llama, Mistral, Qwen2).

These models do not list their layers (``pipeline_layers()``, :mod:`longboat.pipeline.layered`),
so the pipeline recognises them by class, as tensor parallelism's built-in plans do, and lists
their forward for them: the embeddings, each decoder layer, the final norm with the head. The
user's model and its class stay as they are; parameter names stay the model's own
(``transformer.h.0.attn.c_attn.weight``, ``model.layers.0.self_attn.q_proj.weight``).

[Note: transformers stages] The first stage takes ``input_ids`` ``[B, T]``; the last one returns
the logits ``[B, T, V]`` (a tensor, not the model's output object), for the user's ``loss_fn``.
Only the hidden state ``[B, T, D]`` travels between stages; every layer recomputes, from its
shape, what the model's forward would have handed it: position ids ``0..T-1``, the causal mask
through the model's own mask function (with no padding and SDPA attention that is ``None``,
SDPA's ``is_causal``; eager attention gets the materialised mask), and for the Llama family the
rotary ``position_embeddings`` of ``model.rotary_emb``, a module with buffers only that no layer
lists, so every stage keeps it. Nothing here imports transformers until a recognised model's
layer runs, so transformers stays optional. The first stage takes ``input_ids`` alone, so a
padding mask, a cache (generation) or GPT-2's ``token_type_ids`` cannot reach the layers; a
GPT-2 built for cross-attention is refused by name. Dropout draws on each stage's own
generator, so with dropout on, the stages' masks are not those of one process.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

Entry = tuple[tuple[str, ...], Callable[[Any], Any]]


def _position_ids(hidden: torch.Tensor) -> torch.Tensor:
    """``[1, T]``: what the models' forwards make without a cache or given positions."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


@functools.cache
def _mask_keywords(fn: Callable[..., Any]) -> tuple[str, str]:
    """The names ``fn`` (a transformers mask function) gives its embeddings and cache
    arguments: ``inputs_embeds`` and ``cache`` now, ``input_embeds`` and ``past_key_values``
    in earlier 5.x releases."""
    params = inspect.signature(fn).parameters
    embeds = "inputs_embeds" if "inputs_embeds" in params else "input_embeds"
    cache = "cache" if "cache" in params else "past_key_values"
    return embeds, cache


def _mask(config: Any, kind: str, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The attention mask the model's forward builds for a layer of ``kind`` with no padding
    and no cache ([Note: transformers stages])."""
    from transformers import masking_utils

    fn = (
        masking_utils.create_sliding_window_causal_mask
        if kind == "sliding_attention"
        else masking_utils.create_causal_mask
    )
    embeds, cache = _mask_keywords(fn)
    kwargs: dict[str, Any] = {
        "config": config,
        embeds: hidden,
        "attention_mask": None,
        cache: None,
        "position_ids": position_ids,
    }
    if "cache_position" in inspect.signature(fn).parameters:
        kwargs["cache_position"] = position_ids[0]
    return fn(**kwargs)


def _layer_kind(config: Any, i: int) -> str:
    """Which mask decoder layer ``i`` attends with, as the model's forward chooses it: Qwen2's
    ``layer_types``; Mistral's sliding window on every layer when set; else full causal."""
    types = getattr(config, "layer_types", None)
    if types:
        return str(types[i])
    if getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _gpt2(model: nn.Module) -> list[Entry]:
    """``GPT2LMHeadModel``: wte + wpe and dropout, each block, ln_f with the (tied) head."""
    hf: Any = model  # its submodules are attributes of transformers' classes, untyped here
    config = hf.config
    if getattr(config, "add_cross_attention", False):
        raise TypeError(
            "pipeline stages of a GPT2LMHeadModel with add_cross_attention are not built in: "
            "its blocks need the encoder's states; give the model a pipeline_layers() method"
        )
    t = hf.transformer

    def embed(input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        return cast(torch.Tensor, t.drop(t.wte(input_ids) + t.wpe(positions)))

    def block(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        positions = _position_ids(hidden)
        mask = _mask(config, "full_attention", hidden, positions)
        return cast(torch.Tensor, module(hidden, attention_mask=mask, position_ids=positions))

    def head(hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, hf.lm_head(t.ln_f(hidden)))

    return [
        (("transformer.wte", "transformer.wpe", "transformer.drop"), embed),
        *(
            ((f"transformer.h.{i}",), functools.partial(block, layer))
            for i, layer in enumerate(t.h)
        ),
        (("transformer.ln_f", "lm_head"), head),
    ]


def _llama(model: nn.Module) -> list[Entry]:
    """``LlamaForCausalLM`` and the models of the same code (Mistral, Qwen2): the token
    embedding, each decoder layer (with the rotary embedding every stage keeps), the final
    norm with the head."""
    hf: Any = model  # its submodules are attributes of transformers' classes, untyped here
    config = hf.config
    inner = hf.model

    def embed(input_ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, inner.embed_tokens(input_ids))

    def layer(module: nn.Module, kind: str, hidden: torch.Tensor) -> torch.Tensor:
        positions = _position_ids(hidden)
        out = module(
            hidden,
            attention_mask=_mask(config, kind, hidden, positions),
            position_ids=positions,
            position_embeddings=inner.rotary_emb(hidden, positions),
        )
        return cast(torch.Tensor, out)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, hf.lm_head(inner.norm(hidden)))

    layers = list(inner.layers)[: config.num_hidden_layers]
    return [
        (("model.embed_tokens",), embed),
        *(
            ((f"model.layers.{i}",), functools.partial(layer, m, _layer_kind(config, i)))
            for i, m in enumerate(layers)
        ),
        (("model.norm", "lm_head"), head),
    ]


#: Model classes whose layers are built in, by class name ([Note: transformers stages]).
FAMILIES: dict[str, Callable[[nn.Module], list[Entry]]] = {
    "GPT2LMHeadModel": _gpt2,
    "LlamaForCausalLM": _llama,
    "MistralForCausalLM": _llama,
    "Qwen2ForCausalLM": _llama,
}


def recognises(model: nn.Module) -> bool:
    """True for a transformers model of a family whose layers are built in (the class itself,
    not a subclass: a subclass may have changed its forward)."""
    cls = type(model)
    return cls.__name__ in FAMILIES and cls.__module__.startswith("transformers.")


def layers(model: nn.Module) -> list[Entry]:
    """``model``'s forward as ``(submodule paths, callable)`` layers run in order, as
    ``pipeline_layers()`` gives them ([Note: transformers stages])."""
    if not recognises(model):
        raise TypeError(f"no built-in pipeline layers for a {type(model).__name__}")
    return FAMILIES[type(model).__name__](model)
