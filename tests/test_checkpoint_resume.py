"""Exact resume: stopped at step 3 (mid-epoch) and resumed at the same world size and strategy,
a run continues bit for bit like one never stopped: weights, optimizer state, LR schedule, data
position and every RNG (torch, Python, numpy) on every rank."""

from __future__ import annotations

import ckpt_helpers as h
import pytest
import torch

STEPS = 8  # crosses an epoch boundary (5 steps per epoch) after the resume at step 3


def _same(a, b) -> list[str]:
    bad = [k for k in a["state"] if not torch.equal(a["state"][k], b["state"][k])]
    if len(a["optim"]) != len(b["optim"]) or not all(
        ka == kb and torch.equal(x, y)
        for (ka, x), (kb, y) in zip(a["optim"], b["optim"], strict=True)
    ):
        bad.append("optimizer state")
    if a["lr"] != b["lr"]:
        bad.append(f"lr {a['lr']} vs {b['lr']}")
    if not torch.equal(a["draws"][0], b["draws"][0]) or a["draws"][1:] != b["draws"][1:]:
        bad.append("RNG draws")
    if a["scaler"] != b["scaler"]:
        bad.append(f"loss scaler {a['scaler']} vs {b['scaler']}")
    return bad


@pytest.mark.parametrize(
    ("layout", "world"), [("single", 1), ("replicate", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2)]
)
def test_resume_is_bit_exact(ranks, tmp_path, layout, world):
    ckpt = str(tmp_path)
    whole = ranks(world, h.run, layout, world, STEPS, ckpt, (3,))
    resumed = ranks(world, h.run, layout, world, STEPS, ckpt, (), True)
    for r in range(world):
        _loaded_what_was_saved(whole[r], resumed[r], 3)
        assert resumed[r]["step"] == STEPS
        assert not _same(whole[r], resumed[r]), f"rank {r} differs: {_same(whole[r], resumed[r])}"


def _loaded_what_was_saved(whole: dict, resumed: dict, step: int) -> None:
    """The load itself restored the step and the weights saved at ``step``, which differ from
    the fresh ones (a load that did nothing would fail here, whatever training did next)."""
    assert resumed["loaded_step"] == step
    saved = whole["trained"]["saved"][step]
    for k, v in saved.items():
        assert torch.equal(resumed["loaded"][k], v), f"{k} was not restored"
    assert any(not torch.equal(resumed["fresh"][k], v) for k, v in saved.items())


def test_fp16_resume_keeps_the_loss_scale(ranks, tmp_path):
    """The dynamic fp16 loss scale (doubling every 2 clean steps here) resumes exactly too."""
    fp16 = {"precision": {"dtype": "fp16", "initial_scale_power": 4, "loss_scale_window": 2}}
    ckpt = str(tmp_path)
    whole = ranks(2, h.run, "zero2", 2, STEPS, ckpt, (3,), **fp16)
    resumed = ranks(2, h.run, "zero2", 2, STEPS, ckpt, (), True, **fp16)
    assert whole[0]["scaler"]["scale"] > 2.0**4  # it moved after the checkpoint
    for r in range(2):
        _loaded_what_was_saved(whole[r], resumed[r], 3)
        assert not _same(whole[r], resumed[r]), f"rank {r} differs: {_same(whole[r], resumed[r])}"
