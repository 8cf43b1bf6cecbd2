"""Guard-rail tests for the reference models (single process, CPU, a few seconds)."""

from __future__ import annotations

import pytest
import torch

from longboat.models import (
    GPT,
    DigitsCNN,
    gpt_loss,
    gpt_param_count,
    reference_gpt,
    synthetic_tokens,
)


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16)


def test_reference_gpt_param_count() -> None:
    model = reference_gpt()
    n = sum(p.numel() for p in model.parameters())
    # V*d + T*d + L*(12d^2 + 13d) + 2d + V*d (untied head) with V=8192, d=512, L=4, T=128.
    assert n == 2 * 8192 * 512 + 128 * 512 + 4 * (12 * 512 * 512 + 13 * 512) + 2 * 512
    assert n == gpt_param_count(tie_weights=False) == 21_064_704


def test_param_count_formula_matches_other_dims() -> None:
    model = _tiny_gpt()
    n = sum(p.numel() for p in model.parameters())
    assert n == gpt_param_count(vocab_size=64, d_model=32, n_layers=2, seq_len=16)


def test_lm_head_tied_to_token_embedding() -> None:
    model = _tiny_gpt()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    # One Parameter, so optimizers and gradient buckets see it once.
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1


def test_forward_shape_and_loss() -> None:
    model = _tiny_gpt()
    g = torch.Generator().manual_seed(1)
    x, y = synthetic_tokens(3, 16, 64, g)
    assert x.shape == y.shape == (3, 16)
    assert x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    logits = model(x)
    assert logits.shape == (3, 16, 64)
    loss = gpt_loss(logits, y)
    assert loss.ndim == 0
    # At initialisation the prediction is near uniform: loss close to ln(V).
    assert abs(loss.item() - torch.log(torch.tensor(64.0)).item()) < 0.5


def test_gpt_is_causal() -> None:
    model = _tiny_gpt().eval()
    x, _ = synthetic_tokens(2, 16, 64, torch.Generator().manual_seed(2))
    changed = x.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % 64
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, t:], before[:, t:])


def test_gpt_rejects_too_long_sequence() -> None:
    model = _tiny_gpt()
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_digits_cnn_output_shape() -> None:
    model = DigitsCNN()
    out = model(torch.randn(5, 1, 8, 8))
    assert out.shape == (5, 10)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000 <= n <= 50_000
