"""What a strategy supports is declared (``StrategyDefaults`` and the ``Strategy`` protocol in
``strategies/base.py``), never probed: every registered strategy and the tensor-parallel
wrapper answer each member, and the wrapper passes on what its strategy says about memory."""

from __future__ import annotations

import inspect

import pytest

from longboat.strategies.base import Strategy, StrategyDefaults
from longboat.strategies.registry import REGISTRY
from longboat.tensor.strategy import TensorParallelStrategy

# The Strategy protocol's members (its methods, properties and declared attributes).
MEMBERS = sorted(
    {n for n, _ in inspect.getmembers(Strategy) if not n.startswith("_")}
    | set(getattr(Strategy, "__annotations__", {}))
)


@pytest.mark.parametrize(
    "cls", [*REGISTRY.values(), TensorParallelStrategy], ids=lambda c: c.__name__
)
def test_every_strategy_declares_every_member_of_the_protocol(cls):
    assert issubclass(cls, StrategyDefaults)
    missing = [m for m in MEMBERS if not hasattr(cls, m) and m not in _set_in_init(cls)]
    assert not missing, f"{cls.__name__} lacks {missing}"


def _set_in_init(cls: type) -> set[str]:
    """Attributes an instance sets on itself (``self.name = ...``) in ``__init__``."""
    src = inspect.getsource(cls.__init__) if "__init__" in vars(cls) else ""
    return {
        line.split("self.", 1)[1].split("=")[0].split(":")[0].strip()
        for line in src.splitlines()
        if "self." in line and "=" in line
    }


class _Inner(StrategyDefaults):
    name = "inner"

    def expected_memory(self, a: int, k: int) -> dict[str, int]:
        return {
            "parameters": a,
            "gradients": a,
            "optimizer_state": k * a,
            "communication_buffers": 0,
        }

    @property
    def on_disk(self) -> dict[str, int]:
        return {"optimizer_state": 123}

    @property
    def offloaded(self) -> dict[str, int] | None:
        return {"disk": 123, "moved": 7}


def test_the_tensor_parallel_wrapper_passes_on_its_strategys_memory_and_disk():
    inner = _Inner()
    wrapped = TensorParallelStrategy(inner, tensor=None, global_rank=0)  # type: ignore[arg-type]
    assert wrapped.expected_memory(10, 8) == inner.expected_memory(10, 8)
    assert wrapped.on_disk == {"optimizer_state": 123}
    assert wrapped.offloaded == {"disk": 123, "moved": 7}
