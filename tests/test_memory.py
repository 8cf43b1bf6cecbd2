"""Model-state bytes per rank, counted from storages, against the formula of each strategy."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from longboat.models import GPT, gpt_loss, synthetic_tokens


def expected_bytes(strategy: str, a: int, n: int, k: int) -> dict[str, int]:
    """[Note: memory formulas] (``longboat/observe/memory.py``) written out here, apart from the
    strategies that each compute their own row: what the report's formula must say."""
    table = {
        "single": (4 * a, 4 * a, k * a),
        "replicate": (4 * a, 4 * a, k * a),
        "zero-1": (4 * a, 4 * a, k * a / n),
        "zero-2": (4 * a, 4 * a / n, k * a / n),
        "zero-3": (4 * a / n, 4 * a / n, k * a / n),
    }
    p, g, o = table[strategy]
    return {
        "parameters": int(p),
        "gradients": int(g),
        "optimizer_state": int(o),
        "communication_buffers": 0,
    }


def _live_storages() -> dict[int, tuple[int, torch.Tensor]]:
    """Every tensor storage the garbage collector can reach: StorageImpl address -> (bytes, a
    tensor on it, which keeps it alive so its address cannot be reused)."""
    out: dict[int, tuple[int, torch.Tensor]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            st = obj.untyped_storage()
            out.setdefault(st._cdata, (st.nbytes(), obj))
    return out


def _report(strategy: str, stage: int):
    import longboat

    gc.collect()
    before = _live_storages()
    torch.manual_seed(0)
    model = GPT(vocab_size=512, d_model=64, n_layers=2, n_heads=4, seq_len=16, tie_weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = longboat.initialize(
        model,
        opt,
        {
            "strategy": strategy,
            "zero": {"stage": stage, "unit_classes": ["_Block"]},
            "batch": {"micro_batch_size": 2},
            "log": {"progress": False, "level": "WARNING"},
        },
    )
    x, y = synthetic_tokens(2, 16, 512, torch.Generator().manual_seed(1))
    engine.backward(gpt_loss(engine(x), y))
    engine.step()
    report = engine.memory_report()
    del x, y
    # Found without asking the strategy: every storage that appeared since before the model.
    # A finished collective's tensors are dropped by gloo's worker thread, just after wait()
    # returns ([Note: teardown] in comm/collectives.py): ZeRO-1/2's all-gather of the updated
    # shards sends a copy of each (its input may not alias its output), which can still be
    # alive for a moment. What stays is what counts; the wait is bounded (2 s).
    for _ in range(40):
        gc.collect()
        found = sum(n for k, (n, _) in _live_storages().items() if k not in before)
        if found - report.total <= 0.01 * report.total:
            break
        time.sleep(0.05)
    engine.close()
    return report, found


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("strategy", "stage"), [("replicate", 1), ("zero", 1), ("zero", 2), ("zero", 3)]
)
def test_model_state_bytes_match_the_formula(ranks, world, strategy, stage):
    for report, found in ranks(world, _report, strategy, stage):
        a, n = report.trainable_params, world
        # What the process really holds is the model state the report counts, and nothing of
        # note beside it (a few small tensors: the desync check's buffers, optimizer steps).
        assert 0 <= found - report.total <= 0.01 * report.total, (found, str(report))
        assert a == 166_656  # GPT(vocab 512, d 64, 2 layers, seq 16, untied)
        name = strategy if strategy == "replicate" else f"zero-{stage}"
        assert report.expected == expected_bytes(name, a, n, 8)
        assert abs(report.total - report.expected_total) <= 0.05 * report.expected_total, str(
            report
        )
        for c in ("parameters", "gradients", "optimizer_state"):
            assert abs(report.measured[c] - report.expected[c]) <= 0.05 * max(
                report.expected[c], 1
            ), f"{c}: {report}"
        assert report.measured["communication_buffers"] == 0  # nothing left in flight


def test_formulas_with_adam():
    # The strategies' own formulas, beside the table above.
    from longboat.strategies.whole_state import whole_model_state
    from longboat.strategies.zero.policy import ZeroPolicy

    a, n = 1000, 4
    assert sum(whole_model_state(a, 8).values()) == 16 * a
    assert sum(ZeroPolicy.of(1).model_state(a, n, 8).values()) == 4 * a + 4 * a + 8 * a // n
    assert sum(ZeroPolicy.of(2).model_state(a, n, 8).values()) == 4 * a + 12 * a // n
    assert sum(ZeroPolicy.of(3).model_state(a, n, 8).values()) == 16 * a // n
    for name, formula in [("replicate", whole_model_state(a, 8))] + [
        (f"zero-{s}", ZeroPolicy.of(s).model_state(a, n, 8)) for s in (1, 2, 3)
    ]:
        assert formula == expected_bytes(name, a, n, 8), name
