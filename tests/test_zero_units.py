"""Which modules ZeRO-3 makes units ([Note: units run forward] in
``longboat/strategies/zero/units.py``), units whose module runs several times in one forward
([Note: reused units] in ``zero/gather.py``), and the errors for modules that cannot be units."""

from __future__ import annotations

import harness
import pytest
import reference
import torch
import transformers
from torch import nn

import longboat
from longboat.config import ConfigError
from longboat.models import GPT
from longboat.strategies.zero.units import choose_modules
from longboat.testing import RankFailure


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


class Stack(nn.Module):
    """Blocks kept in a ``ModuleList`` that the parent runs one by one: the list has more
    parameters than ``unit_min_params`` = 300, each layer fewer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(12, 12) for _ in range(3))
        self.head = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


# -- the policy, without processes ---------------------------------------------------------------


def test_a_container_is_never_a_unit_its_blocks_are():
    model = _gpt2()
    chosen = choose_modules(model, [], 1_000_000)
    # transformers declares GPT2Block in _no_split_modules; transformer.h is a ModuleList
    assert [type(m).__name__ for m in chosen] == ["GPT2Block", "GPT2Block"]
    assert chosen == list(model.transformer.h)
    # by size, the list (468 parameters) is passed over for the unit around it
    assert choose_modules(Stack(), [], 300, by_size=True) == []


def test_the_size_policy_descends_into_containers():
    model = Stack()
    assert choose_modules(model, [], 150, by_size=True) == [*model.layers, model.head]


def test_longboat_gpt_declares_its_blocks_and_a_set_size_wins():
    model = GPT(vocab_size=64, d_model=32, n_layers=3, n_heads=2, seq_len=8)
    assert choose_modules(model, [], 1_000_000) == list(model.blocks)
    # each block holds about 12.7k parameters: by a size of 20k, only the root is left
    assert choose_modules(model, [], 20_000, by_size=True) == []


def test_naming_a_container_or_a_missing_class_is_refused():
    with pytest.raises(ConfigError, match=r"zero\.unit_classes.*\['ModuleList'\].*never runs"):
        choose_modules(Stack(), ["ModuleList"], 1)
    with pytest.raises(ConfigError, match=r"zero\.unit_classes.*\['Block'\].*does not have"):
        choose_modules(_gpt2(), ["Block"], 1)


# -- training ------------------------------------------------------------------------------------


def _train_stack(unit_min_params: int) -> float:
    torch.manual_seed(0)
    model = Stack()
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            **harness.QUIET,
            "strategy": "zero",
            "zero": {"stage": 3, "unit_min_params": unit_min_params},
            "batch": {"micro_batch_size": 4},
        },
    )
    x = torch.randn(4, 12)
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    engine.close()
    return float(loss)


def test_a_module_list_above_the_size_trains(ranks):
    # Before containers were passed over, the list was a unit never gathered: a crash on a
    # parameter of shape [0] in the first forward.
    a, b = ranks(2, _train_stack, 300)
    assert a == b


@pytest.mark.parametrize(("stage", "world"), [(1, 2), (2, 2), (3, 1), (3, 2), (3, 4)])
def test_a_module_reused_in_one_forward_equals_plain_pytorch(ranks, stage, world):
    # shared runs three times, first on the data (no input gradient): before [Note: reused
    # units], stage 3 reduced it after its last call's backward, and the first call's gradient
    # arrived after the reduction had started.
    units = {"unit_classes": ["Linear"]} if stage == 3 else {"bucket_mb": 0.0001}
    recipe = reference.Recipe(model="reused", optimizer="adamw", clip=0.5)
    strategy = {"strategy": "zero", "zero": {"stage": stage, **units}}
    harness.run_and_compare(ranks, world, strategy, recipe, 6, 2, 16, tol=1e-5)


class Peek(nn.Module):
    """Reads ``proj``'s parameters without calling it (``how``: into a matmul, which fails on a
    released parameter, or into a sum, which does not)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(12, 12)
        self.head = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "matmul":
            return self.head(torch.tanh(nn.functional.linear(x, self.proj.weight)))
        return self.head(x) + self.proj.weight.sum()


def _train_peek(how: str) -> None:
    torch.manual_seed(0)
    model = Peek(how)
    engine = longboat.initialize(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        {
            **harness.QUIET,
            "strategy": "zero",
            "zero": {"stage": 3, "unit_classes": ["Linear"]},
            "batch": {"micro_batch_size": 4},
        },
    )
    engine.backward(engine(torch.randn(4, 12)).square().mean())
    engine.step()


@pytest.mark.parametrize("how", ["matmul", "sum"])
def test_a_unit_whose_parameters_another_module_reads_is_named(ranks, how):
    with pytest.raises(RankFailure) as failure:
        ranks(2, _train_peek, how)
    assert set(failure.value.failures) == {0, 1}
    for text in failure.value.failures.values():
        assert "ConfigError" in text and "proj (Linear)" in text, text
        assert "zero.unit_classes" in text
