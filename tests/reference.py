"""The plain PyTorch reference every equivalence test compares with. It imports nothing from
longboat (``test_reference_is_plain`` holds it to that), and shares no code with it.

It trains a model the way a single-process PyTorch script would, on exactly the samples the
distributed ranks saw: for each optimizer step, ``zero_grad``; for each micro-batch and each rank
(in rank order), forward that rank's samples and backward ``loss / (accumulation x ranks)``, so
that the gradient is the average over all ranks' micro-batches as data parallelism defines it;
then ``clip_grad_norm_``, ``optimizer.step()``, ``scheduler.step()``.

One thing plain PyTorch cannot say by itself is what buffers (BatchNorm's running statistics)
become when several ranks run forwards: the data-parallel convention (DDP's
``broadcast_buffers``) is that rank 0's buffers count. The loop states it in plain terms: every
rank's forward of a micro-batch starts from the same buffers, and after the micro-batch the
buffers are what rank 0's forward left.

Uneven inputs (ranks that ran out of samples): a rank with no samples in a micro-batch (an empty
list) does nothing in it; the micro-batch's losses are divided by ``accumulation x`` the number
of ranks that had samples, so its gradient is the average over those ranks, and the buffers are
what the first of them left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

# -- models ------------------------------------------------------------------------------------


class TinyNet(nn.Module):
    """An MLP with a LayerNorm and a frozen layer."""

    def __init__(self, d_in: int = 12, d_hidden: int = 24, n_out: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.mid = nn.Linear(d_hidden, d_hidden)
        self.out = nn.Linear(d_hidden, n_out)
        self.frozen = nn.Linear(d_hidden, d_hidden)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        h = torch.tanh(self.mid(h)) + 0.1 * self.frozen(h)
        return self.out(h)


class TiedNet(nn.Module):
    """Two Linear modules sharing one weight (tied parameters across modules), odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 12, bias=False)
        self.mid = nn.Linear(12, 7)
        self.back = nn.Linear(7, 12)
        self.head = nn.Linear(12, 12)
        self.head.weight = self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x))
        h = torch.tanh(self.back(torch.tanh(self.mid(h))))
        return self.head(h)


class Experts(nn.Module):
    """Routed experts (as in a mixture of experts): expert k runs only on the samples routed to
    it, so it is used on some micro-batches and some ranks and not on others."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            mask = route == k
            if bool(mask.any()):
                out = out.index_put((mask.nonzero().squeeze(1),), expert(h[mask]))
        return h + out


class ZooNet(nn.Module):
    """Everything that hides data-parallel mistakes in one small model: BatchNorm (buffers), an
    LSTM (a recurrent layer), a frozen layer, two modules sharing one weight (tied), routed
    experts (conditionally used parameters), a parameter that is never used, and sizes (9, 5, 7)
    that do not divide 2 or 4 ranks. Inputs: ``x`` [B, 3, 5] and ``route`` [B] in {0, 1, 2}."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 9, bias=False)  # a bias before BatchNorm has no gradient
        self.norm = nn.BatchNorm1d(9)
        self.rnn = nn.LSTM(9, 9, batch_first=True)
        self.frozen = nn.Linear(9, 9)
        self.frozen.requires_grad_(False)
        self.mix = nn.Linear(9, 9)
        self.moe = Experts(9, 3)
        self.decode = nn.Linear(9, 9, bias=False)
        self.decode.weight = self.mix.weight  # tied across two modules
        self.head = nn.Linear(9, 5)
        self.never = nn.Parameter(torch.randn(7))  # trainable, in the optimizer, never used

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.embed(x)
        h = self.norm(h.reshape(b * t, -1)).reshape(b, t, -1)
        h, _ = self.rnn(h)
        h = h[:, -1]
        h = torch.tanh(self.mix(h)) + 0.1 * self.frozen(h)
        h = self.moe(h, route)
        return self.head(torch.tanh(self.decode(h)))


class Gate(nn.Module):
    """A residual layer used only when its input's mean is positive (on some micro-batches, not
    others), with a parameter that is never used."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.extra = nn.Linear(d, d)
        self.unused = nn.Parameter(torch.ones(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.extra(h) if float(h.detach().mean()) > 0 else h


def chain_net() -> nn.Sequential:
    """Eight layers in order (for pipeline stages): a conditionally used layer with a
    never-used parameter, a frozen layer, a LayerNorm, odd widths."""
    frozen = nn.Linear(24, 24)
    frozen.requires_grad_(False)
    return nn.Sequential(
        nn.Linear(12, 24),
        nn.Tanh(),
        Gate(24),
        nn.LayerNorm(24),
        nn.Linear(24, 9),
        nn.Linear(9, 24),
        frozen,
        nn.Linear(24, 12),
    )


class ReusedNet(nn.Module):
    """One layer applied three times in a forward (weights shared across depth, as ALBERT's
    layers are), the first time to the data itself, whose input needs no gradient; beside it a
    layer used once."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(12, 12)
        self.mid = nn.Linear(12, 12)
        self.head = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.shared(h))
        return self.head(torch.tanh(self.shared(h)))


# -- real models -------------------------------------------------------------------------------
# Small configurations of models people train: dropout off (a forward is then a function of the
# weights and the inputs alone), special token ids inside the small vocabulary (transformers
# warns about ids outside it). transformers is imported where a model is built, so that tests
# that do not build one do not pay for the import.

VOCAB = 128
SEQ = 8


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and a projected shortcut where
    the shape changes. The convolutions have no bias: BatchNorm right after them would cancel it
    (and its gradient, zero in exact arithmetic, would be rounding noise)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet (BatchNorm's running statistics are buffers) for [B, 3, 8, 8] images and
    10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()
        )
        self.layers = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 32, stride=2))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))


class LSTMLM(nn.Module):
    """A language model: embedding, a two-layer LSTM, a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.rnn = nn.LSTM(64, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(tokens))
        return self.head(h)


def gpt2() -> nn.Module:
    import transformers as tf

    cfg = tf.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return tf.GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    """Grouped-query attention: 4 query heads share 2 key/value heads."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )  # fmt: skip
    return tf.LlamaForCausalLM(cfg)


def bert() -> nn.Module:
    """Masked LM; the decoder's weight is tied to the word embeddings."""
    import transformers as tf

    cfg = tf.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return _key_bias_frozen(tf.BertForMaskedLM(cfg))


def t5() -> nn.Module:
    """Encoder-decoder; one embedding shared by the encoder, the decoder and the head."""
    import transformers as tf

    cfg = tf.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )  # fmt: skip
    return tf.T5ForConditionalGeneration(cfg)


def mixtral() -> nn.Module:
    """Routed experts, 2 of 8 per token: with 8-16 tokens in a micro-batch some experts get
    none, so their rows of the fused expert weights get no gradient there."""
    import transformers as tf

    cfg = tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=SEQ, attention_dropout=0.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )  # fmt: skip
    return tf.MixtralForCausalLM(cfg)


def albert() -> nn.Module:
    """One AlbertLayer applied at each of 3 depths (weights shared across depth). Its width
    (hidden 256, intermediate 2048: about 1.3M parameters) makes it a module of at least a
    million parameters, a unit of ZeRO-3's default size policy, run three times per forward."""
    import transformers as tf

    cfg = tf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=64, hidden_size=256, intermediate_size=2048,
        num_hidden_layers=3, num_hidden_groups=1, inner_group_num=1, num_attention_heads=4,
        max_position_embeddings=SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    return _key_bias_frozen(tf.AlbertForMaskedLM(cfg))


def _key_bias_frozen(model: nn.Module) -> nn.Module:
    """``model`` with its attention key biases frozen. Softmax ignores a key bias (it adds the
    same to every score of a query), so its gradient is zero in exact arithmetic: trained, the
    bias and its momentum would hold only rounding noise (1e-13), which no relative tolerance
    can compare. Frozen, it changes nothing in exact arithmetic."""
    for name, p in model.named_parameters():
        if name.endswith("key.bias"):
            p.requires_grad_(False)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "tiny": TinyNet,
    "tied": TiedNet,
    "zoo": ZooNet,
    "chain": chain_net,
    "reused": ReusedNet,
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "t5": t5,
    "mixtral": mixtral,
    "albert": albert,
    "resnet": ResNet,
    "lstm": LSTMLM,
}


# -- data --------------------------------------------------------------------------------------


def dataset(n: int, seed: int = 1) -> TensorDataset:
    """``n`` samples (x [12], y in 0..11) for TinyNet, TiedNet and ReusedNet."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = torch.randint(0, 12, (n,), generator=g)
    return TensorDataset(x, y)


# Routes: expert 0 is common, 1 less so, 2 rare, so that within a step of 16 samples expert 2 is
# often used by one rank only, or on one micro-batch only, or by no rank at all.
ROUTE_WEIGHTS = (0.6, 0.32, 0.08)


def zoo_dataset(n: int, seed: int = 1) -> TensorDataset:
    """``n`` samples (sample id, x [3, 5], route, y in 0..4) for ZooNet."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 5, generator=g)
    route = torch.multinomial(torch.tensor(ROUTE_WEIGHTS), n, replacement=True, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return TensorDataset(torch.arange(n), x, route, y)


def token_dataset(n: int, seed: int = 1) -> TensorDataset:
    """``n`` samples (tokens [SEQ], a target per position) for language models. The targets are
    drawn at random: equivalence needs the same loss on both sides, not a meaningful one."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randint(0, VOCAB, (n, SEQ), generator=g),
        torch.randint(0, VOCAB, (n, SEQ), generator=g),
    )


def masked_dataset(n: int, seed: int = 1) -> TensorDataset:
    """``n`` samples (tokens [SEQ], targets [SEQ]) for masked language models: about a quarter
    of the positions (at least one per sample) have a target, the others -100 (ignored)."""
    tokens, targets = token_dataset(n, seed).tensors
    g = torch.Generator().manual_seed(seed + 1)
    keep = torch.rand(n, SEQ, generator=g) < 0.25
    keep[torch.arange(n), torch.randint(0, SEQ, (n,), generator=g)] = True
    return TensorDataset(tokens, torch.where(keep, targets, torch.full_like(targets, -100)))


def seq2seq_dataset(n: int, seed: int = 1) -> TensorDataset:
    """``n`` samples (input ids [SEQ], attention mask [SEQ], decoder input ids [SEQ], targets
    [SEQ]) for encoder-decoders, in the order of T5's forward arguments; the inputs are padded
    after 5 to 8 tokens."""
    tokens, targets = token_dataset(n, seed).tensors
    g = torch.Generator().manual_seed(seed + 1)
    length = torch.randint(5, SEQ + 1, (n, 1), generator=g)
    mask = (torch.arange(SEQ) < length).long()
    decoder = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return TensorDataset(tokens * mask, mask, decoder, targets)


def image_dataset(n: int, seed: int = 1) -> TensorDataset:
    """``n`` samples (image [3, 8, 8], y in 0..9) for the ResNet."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=g))


def indexed(data: TensorDataset) -> TensorDataset:
    """``data`` with the sample id in front, so a rank can say which samples it saw."""
    return TensorDataset(torch.arange(len(data)), *data.tensors)


# -- the recipe both sides follow --------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """One training run, described in plain terms, so that the reference and a distributed run
    build the same model, optimizer and schedule."""

    model: str = "tiny"
    optimizer: str = "adamw"  # adamw (weight decay 0.1), sgd (momentum 0.9), adam
    clip: float = 0.0  # global 2-norm; 0 = off
    scheduler: bool = False  # StepLR(step_size=3, gamma=0.5)
    precision: str = "fp32"  # fp32, bf16 (autocast), fp16 (autocast + loss scale)
    loss_scale: float = 2.0**8  # fp16: the initial scale on both sides
    # fp16: good steps after which the scale doubles (an overflow halves it at once)
    loss_scale_window: int = 1000

    def build(self) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = MODELS[self.model]()
        if self.optimizer == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(
                model.parameters(), lr=3e-3, weight_decay=0.1
            )
        elif self.optimizer == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = (
            torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if self.scheduler else None
        )
        return model, opt, sched


def forward_loss(
    model: Callable[..., Any],
    batch: Sequence[torch.Tensor],
    autocast: torch.dtype | None = None,
) -> torch.Tensor:
    """Cross-entropy of the model on ``batch`` = (inputs..., targets), the forward under
    ``torch.autocast`` to ``autocast`` when given, the loss in fp32 (:func:`loss_of`)."""
    *inputs, y = batch
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = model(*inputs)
    return loss_of(out, y)


def loss_of(out: Any, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a model's output against targets ``y``, in fp32. A transformers model's
    output gives its ``logits``; targets per position ([B, T] against logits [B, T, V]) count
    every position with a target (not -100) once."""
    out = getattr(out, "logits", out)
    if y.dim() > 1:
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    return nn.functional.cross_entropy(out.float(), y)


# -- the plain loop ----------------------------------------------------------------------------


@dataclass
class PlainRun:
    """What the reference computed."""

    losses: list[list[list[float]]]  # [step][micro-batch][rank]
    state: dict[str, torch.Tensor]  # the model's state_dict (parameters and buffers)
    optim: dict[str, dict[str, Any]]  # parameter name -> its optimizer state
    lrs: list[float]  # learning rate of the first group after each step
    # [step][micro-batch][rank] -> names of the parameters that received a gradient
    used: list[list[list[set[str]]]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # fp16: steps skipped for overflow (1-based)


def plain_train(
    recipe: Recipe,
    data: TensorDataset,
    order: Sequence[Sequence[Sequence[Sequence[int]]]],
    poison: tuple[int, int] | None = None,
) -> PlainRun:
    """Train as one process would on ``order[step][micro][rank]`` = that rank's sample ids
    (``data``'s first tensor is the sample id; empty for a rank that had no samples left).
    ``poison = (step, rank)`` (1-based step)
    multiplies that rank's loss by inf in that step, so that fp16's scaler skips it."""
    model, opt, sched = recipe.build()
    accum = len(order[0])
    names = {id(p): n for n, p in model.named_parameters()}
    current: set[str] = set()
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda q: current.add(names[id(q)]))
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(recipe.precision)
    scaler = (
        torch.amp.GradScaler(
            "cpu", init_scale=recipe.loss_scale, growth_interval=recipe.loss_scale_window
        )
        if recipe.precision == "fp16"
        else None
    )
    run = PlainRun(losses=[], state={}, optim={}, lrs=[])
    for step_order in order:
        opt.zero_grad(set_to_none=True)
        step_losses, step_used = [], []
        for micro in step_order:
            before = {n: b.clone() for n, b in model.named_buffers()}
            after_first: dict[str, torch.Tensor] | None = None
            losses, used = [], []
            ranks_with_samples = sum(1 for ids in micro if len(ids))  # all, unless some ran out
            for r, ids in enumerate(micro):
                if not len(ids):  # this rank had no samples left: nothing to do
                    losses.append(float("nan"))
                    used.append(set())
                    continue
                if after_first is not None:  # every rank's forward starts from the same buffers
                    _set_buffers(model, before)
                _, *batch = data[list(ids)]  # (sample ids, inputs..., targets)
                current.clear()
                loss = forward_loss(model, batch, low)
                if poison == (len(run.losses) + 1, r):
                    loss = loss * float("inf")
                scaled = loss / (accum * ranks_with_samples)
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
                losses.append(float(loss.detach()))
                used.append(set(current))
                if after_first is None:
                    after_first = {n: b.clone() for n, b in model.named_buffers()}
            if after_first is not None:  # rank 0's buffers count (the first rank with samples)
                _set_buffers(model, after_first)
            step_losses.append(losses)
            step_used.append(used)
        run.losses.append(step_losses)
        run.used.append(step_used)
        params = [p for p in model.parameters() if p.requires_grad]
        if scaler is not None:
            scaler.unscale_(opt)
        if recipe.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, recipe.clip)
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                run.skipped.append(len(run.losses))
                run.lrs.append(opt.param_groups[0]["lr"])
                continue  # a skipped step does not move the schedule
        else:
            opt.step()
        if sched is not None:
            sched.step()
        run.lrs.append(opt.param_groups[0]["lr"])
    run.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        run.optim[names[id(p)]] = {
            k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()
        }
    return run


def _set_buffers(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(values[n])


# -- comparisons -------------------------------------------------------------------------------


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference over tensors, each relative to the largest magnitude in ``b``'s
    tensor; tensors that are not floating point must be equal."""
    assert a.keys() == b.keys(), f"keys differ: {set(a) ^ set(b)}"
    worst = 0.0
    for k in a:
        x, y = a[k].detach(), b[k].detach()  # parameters may come straight from a model
        assert x.shape == y.shape, f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        if not y.is_floating_point():
            assert torch.equal(x, y), f"{k}: {x} vs {y}"
            continue
        scale = float(y.abs().max()) if y.numel() else 0.0
        diff = float((x - y).abs().max()) if y.numel() else 0.0
        worst = max(worst, diff / max(scale, 1e-12))
    return worst
