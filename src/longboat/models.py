"""Reference models for tests, benchmarks and ``longboat bench``/``plan``.

Two models, both small enough for CPU:

* :class:`GPT` — a GPT-2-style decoder-only transformer. The reference configuration
  (:func:`reference_gpt`, untied LM head) has 21,064,704 parameters; :func:`gpt_param_count`
  gives the closed form so tests and planners need not build the model to know its size.
* :class:`DigitsCNN` — a tiny CNN for the 8x8 scikit-learn digits (10 classes).

This module depends on torch only, never on the rest of longboat, so strategies and tests can
import it without cycles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "DigitsCNN",
    "gpt_loss",
    "gpt_param_count",
    "reference_gpt",
    "synthetic_tokens",
]


#: a layer of ``GPT.pipeline_layers()``: the submodules it uses and what runs it
_Layer = tuple[tuple[str, ...], Callable[[torch.Tensor], torch.Tensor]]
#: a layer with the parts a pipeline stage boundary may fall between
_LayerInParts = tuple[tuple[str, ...], Callable[[torch.Tensor], torch.Tensor], tuple[_Layer, ...]]


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection.

    The forward reads the number of heads from the projection's output width (``head_dim`` is
    fixed), so it runs unchanged when tensor parallelism gives this rank some of the heads, and
    the sequence length from that output too (sequence parallelism divides ``x`` but the
    projection gathers it).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        # [B, T, H*hd] -> [B, H, T, hd]: SDPA attends over the second-to-last dim per head.
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        out: torch.Tensor = self.resid_drop(self.proj(y))
        return out


class _MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.proj(F.gelu(self.fc(x))))
        return out


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = _MLP(d_model, dropout)

    #: the halves ``forward(x, part=...)`` runs alone, in order
    PARTS = ("attention", "mlp")

    def forward(self, x: torch.Tensor, part: str | None = None) -> torch.Tensor:
        """Both halves, or only ``part`` (one of :attr:`PARTS`): a pipeline stage boundary may
        fall between them, and each stage still calls the block itself (hooks on the block,
        as ZeRO-3's gather, fire on each stage's half)."""
        if part not in (None, *self.PARTS):
            raise ValueError(f"part={part!r}: a block's parts are {self.PARTS} (or None: both)")
        if part != "mlp":
            x = x + self.attn(self.ln1(x))
        if part != "attention":
            x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """A GPT-style decoder-only language model.

    Token and learned position embeddings, ``n_layers`` pre-LayerNorm blocks (causal
    self-attention through :func:`torch.nn.functional.scaled_dot_product_attention` and a 4x
    GELU MLP), a final LayerNorm and a bias-free LM head whose weight *is* the token embedding
    (tied: one ``Parameter``, so ``model.parameters()`` yields it once).

    Args:
        vocab_size: number of token ids.
        d_model: width of the residual stream; must be divisible by ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        seq_len: longest sequence the position embedding covers.
        dropout: dropout probability on embeddings, attention and residual branches.
        tie_weights: share the LM head's weight with the token embedding.
    """

    #: The repeated block, declared as transformers models declare theirs: ZeRO-3 makes each
    #: one a unit by default ([Note: units run forward] in ``strategies/zero/units.py``).
    _no_split_modules = ("_Block",)

    def __init__(
        self,
        vocab_size: int = 8192,
        d_model: int = 512,
        n_layers: int = 4,
        n_heads: int = 8,
        seq_len: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
    ) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        # Every layer, then the residual projections again: children before the modules that
        # rescale them, as ``apply`` goes, in the order that has always drawn these values.
        modules = list(self.modules())
        for module in modules:
            if not isinstance(module, (_CausalSelfAttention, _MLP)):
                self._init_weights(module)
        for module in modules:
            if isinstance(module, (_CausalSelfAttention, _MLP)):
                self._init_weights(module)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2's initialisation of one of this model's modules, after its children (the
        ``apply``-style hook of transformers' ``_init_weights``, which ZeRO-3 calls on a model
        built on the meta device): N(0, 0.02) everywhere, and the projections that write into
        the residual stream scaled by 1/sqrt(2 * n_layers) so its variance does not grow with
        depth."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (_CausalSelfAttention, _MLP)):
            std = 0.02 / math.sqrt(2 * self.n_layers)
            nn.init.normal_(module.proj.weight, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids ``[B, T]`` (``T <= seq_len``) to logits ``[B, T, vocab_size]``."""
        x = self._embed(idx)
        for block in self.blocks:
            x = block(x)
        return self._head(x)

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len={self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        out: torch.Tensor = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        return out

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out

    def pipeline_layers(self) -> list[_Layer | _LayerInParts]:
        """:meth:`forward` as layers run in order, each with the submodules it uses, so that
        pipeline stages can split the model and keep its parameter names: the embeddings, each
        block, the final LayerNorm with the head. A block also lists its two halves, attention
        and MLP, so that a stage boundary may fall inside it where the head, heavier than a
        block, would leave whole blocks unbalanced ([Note: layers in parts] in
        ``longboat/pipeline/layered.py``). (With tied weights the embedding and the head share
        a parameter; on different stages both hold it and keep it equal, see
        ``longboat/pipeline/tied.py``.)"""
        return [
            (("tok_emb", "pos_emb", "drop"), self._embed),
            *(
                (
                    (f"blocks.{i}",),
                    block,
                    (
                        ((f"blocks.{i}.ln1", f"blocks.{i}.attn"), partial(block, part="attention")),
                        ((f"blocks.{i}.ln2", f"blocks.{i}.mlp"), partial(block, part="mlp")),
                    ),
                )
                for i, block in enumerate(self.blocks)
            ),
            (("ln_f", "lm_head"), self._head),
        ]


def gpt_param_count(
    vocab_size: int = 8192,
    d_model: int = 512,
    n_layers: int = 4,
    seq_len: int = 128,
    tie_weights: bool = True,
) -> int:
    """Exact number of parameters of :class:`GPT` with these dimensions.

    Per block: QKV ``3d^2 + 3d``, attention projection ``d^2 + d``, MLP ``8d^2 + 5d``, two
    LayerNorms ``4d``: ``12d^2 + 13d``. Plus embeddings ``(V + T) d`` and the final
    LayerNorm ``2d``, plus ``V d`` for an untied head.
    """
    d = d_model
    head = 0 if tie_weights else vocab_size * d
    return (vocab_size + seq_len) * d + n_layers * (12 * d * d + 13 * d) + 2 * d + head


def reference_gpt() -> GPT:
    """The reference GPT of benchmarks: 4 layers, d_model 512, 8 heads, sequence 128, vocabulary
    8192 and an untied head: 21,064,704 parameters."""
    return GPT(tie_weights=False)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of ``logits [B, T, V]`` against ``targets [B, T]`` over all tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_tokens(
    batch: int, seq_len: int, vocab: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random next-token batch: ``x`` and ``y`` are ``[batch, seq_len]`` int64, ``y`` is ``x``
    shifted left by one (drawn as one ``seq_len + 1`` sequence, so ``y[:, :-1] == x[:, 1:]``).
    """
    seq = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 one-channel images (scikit-learn digits), 10 classes.

    conv 1->16 3x3, ReLU, conv 16->32 3x3, ReLU, max-pool 2 (-> 32x4x4), linear 512->64, ReLU,
    linear 64->10. 38,282 parameters. ``forward`` takes ``[B, 1, 8, 8]`` floats and returns
    logits ``[B, 10]``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 64),
            nn.ReLU(),
            nn.Linear(64, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``[B, 1, 8, 8]`` to class logits ``[B, 10]``."""
        out: torch.Tensor = self.classifier(self.features(x))
        return out
