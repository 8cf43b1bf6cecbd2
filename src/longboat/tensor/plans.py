"""Tensor-parallel plans: which style each module runs in, by module-name pattern.

A pattern is a module name whose components may be shell wildcards, one component each:
``blocks.*.attn.qkv`` names ``blocks.0.attn.qkv`` and ``blocks.11.attn.qkv``, not
``blocks.0.x.attn.qkv``. The first pattern that names a module gives its style; modules no
pattern names stay whole. A plan also lists module attributes that count something divided
among the ranks (attention heads: ``divide``, set to their share) or that must divide without
being changed (``check``), so a head count that does not divide is an error naming it, not a
wrong result.

Built-in plans, for the module layouts of longboat's reference GPT and of Hugging Face's GPT-2
and Llama, are chosen by the model's class unless the config names one.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from torch import nn

from longboat.tensor.layout import LayoutError
from longboat.tensor.styles import STYLES, Colwise, Style


@dataclass(frozen=True)
class Plan:
    """Module-name patterns and their styles, in order; attributes to divide and to check."""

    name: str
    styles: tuple[tuple[str, Style], ...]
    divide: tuple[tuple[str, str], ...] = ()
    check: tuple[tuple[str, str], ...] = ()

    def style_for(self, module_name: str) -> tuple[str, Style] | None:
        """The first (pattern, style) naming ``module_name``."""
        for pattern, style in self.styles:
            if matches(pattern, module_name):
                return pattern, style
        return None


def matches(pattern: str, name: str) -> bool:
    """True when ``pattern`` names module ``name`` (wildcards within one component)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True)
    )


def style_of(where: str, value: Any) -> Style:
    """A style from a config value: a name, or a table ``{style = "colwise", fused = 3}``
    (``fused``: stacked blocks; ``input = "whole"``: a colwise layer whose input a
    ``gather_sequence`` module already gathered)."""
    keys = {"style", "fused", "input"}
    if isinstance(value, str):
        name, fused, whole = value, 1, False
    elif isinstance(value, dict) and "style" in value and set(value) <= keys:
        name, fused = value["style"], value.get("fused", 1)
        if value.get("input", "sequence") not in ("sequence", "whole"):
            raise LayoutError(f"{where}: input = {value['input']!r}; use 'whole' or 'sequence'")
        whole = value.get("input") == "whole"
    else:
        raise LayoutError(
            f"{where} = {value!r}: give a style name ({', '.join(STYLES)}) or a table "
            "{style = 'colwise', fused = 3, input = 'whole'}"
        )
    if name not in STYLES:
        raise LayoutError(f"{where} = {name!r}: unknown style; choose one of {', '.join(STYLES)}")
    if fused != 1 or whole:
        if name != "colwise" or not isinstance(fused, int) or fused < 1:
            raise LayoutError(
                f"{where}: fused = {fused!r} and input = 'whole' apply to colwise layers only "
                "(fused: a whole number of stacked blocks, 3 for q|k|v)"
            )
        return Colwise(fused=fused, whole_input=whole)
    return STYLES[name]


def _plan(name: str, entries: dict[str, Any], **kw: Any) -> Plan:
    styles = tuple((p, style_of(f"tensor_parallel.plan[{p!r}]", v)) for p, v in entries.items())
    return Plan(name, styles, **kw)


_QKV = {"style": "colwise", "fused": 3}

#: longboat.models.GPT: fused q|k|v, an MLP, a vocabulary-parallel embedding and head (the two
#: are cut alike, along the vocabulary, so a tied weight stays one parameter).
GPT = _plan(
    "gpt",
    {
        "tok_emb": "rowwise",
        "drop": "split_sequence",
        "blocks.*.ln1": "sequence",
        "blocks.*.attn.qkv": _QKV,
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln2": "sequence",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "ln_f": "gather_sequence",
        "lm_head": "colwise_gather_output",
    },
    divide=(("blocks.*.attn", "n_heads"),),
)

#: transformers' GPT2LMHeadModel (Conv1D layers, fused c_attn).
GPT2 = _plan(
    "gpt2",
    {
        "transformer.wte": "rowwise",
        "transformer.drop": "split_sequence",
        "transformer.h.*.ln_1": "sequence",
        "transformer.h.*.attn.c_attn": _QKV,
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.ln_2": "sequence",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "transformer.ln_f": "gather_sequence",
        "lm_head": "colwise_gather_output",
    },
    divide=(("transformer.h.*.attn", "num_heads"), ("transformer.h.*.attn", "split_size")),
)

#: transformers' LlamaForCausalLM (separate q, k, v; gated MLP). Its attention reads the
#: sequence length from its input: with sequence parallelism the attention block gathers its
#: input once, and q, k and v take it whole.
_WHOLE = {"style": "colwise", "input": "whole"}
LLAMA = _plan(
    "llama",
    {
        "model.embed_tokens": "rowwise",
        "model.layers.0": "split_sequence",
        "model.layers.*.input_layernorm": "sequence",
        "model.layers.*.self_attn": "gather_sequence",
        "model.layers.*.self_attn.q_proj": _WHOLE,
        "model.layers.*.self_attn.k_proj": _WHOLE,
        "model.layers.*.self_attn.v_proj": _WHOLE,
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.post_attention_layernorm": "sequence",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "model.norm": "gather_sequence",
        "lm_head": "colwise_gather_output",
    },
    check=(
        ("model.layers.*.self_attn", "config.num_attention_heads"),
        ("model.layers.*.self_attn", "config.num_key_value_heads"),
    ),
)

BUILT_IN = {p.name: p for p in (GPT, GPT2, LLAMA)}
#: Model classes whose built-in plan is chosen when the config says "auto".
BY_CLASS = {"GPT": "gpt", "GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}


def resolve(plan: str | dict[str, Any], model: nn.Module, divide: dict[str, list[str]]) -> Plan:
    """The plan the config names: a built-in one by name, ``"auto"`` (by the model's class), or
    a table of patterns with ``divide``'s attributes."""
    if isinstance(plan, dict):
        extra = tuple((p, a) for p, attrs in divide.items() for a in attrs)
        return _plan("custom", plan, divide=extra)
    if plan == "auto":
        cls = type(model).__name__
        if cls not in BY_CLASS:
            raise LayoutError(
                f"tensor_parallel.plan = 'auto': no built-in plan for a {cls}; name one "
                f"({', '.join(BUILT_IN)}) or give a table of module patterns, e.g. "
                "{'blocks.*.fc' = 'colwise', 'blocks.*.proj' = 'rowwise'}"
            )
        plan = BY_CLASS[cls]
    if plan not in BUILT_IN:
        raise LayoutError(
            f"tensor_parallel.plan = {plan!r}: choose 'auto', one of {', '.join(BUILT_IN)}, "
            "or a table of module patterns"
        )
    built = BUILT_IN[plan]
    if divide:
        extra = tuple((p, a) for p, attrs in divide.items() for a in attrs)
        built = Plan(built.name, built.styles, built.divide + extra, built.check)
    return built


def has_plan(plan: str | dict[str, Any], model: nn.Module) -> bool:
    """Whether the config's ``tensor_parallel.plan`` names a plan for ``model`` (what
    :func:`resolve` would find, asked without building it): a table of patterns, a built-in by
    name, or ``"auto"`` for a model class with a built-in plan."""
    if isinstance(plan, dict):
        return True
    if plan == "auto":
        return type(model).__name__ in BY_CLASS
    return plan in BUILT_IN
