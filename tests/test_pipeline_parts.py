"""Layers in parts ([Note: layers in parts] in ``pipeline/layered.py``) and the measured split
chosen for the run's schedule ([Note: a split for the schedule] in ``pipeline/partition.py``):
a GPT whose stage boundary falls inside a block trains as plain PyTorch does, under 1F1B,
interleaved, ZeRO-3 and tensor parallelism; a stage holding a whole block calls it once; the
split for the schedule is the best the simulator finds, by brute force."""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

import harness
import pytest
import reference
import test_pipeline
import torch
from torch import nn

from longboat.models import GPT
from longboat.pipeline import layered, measure, partition, schedules
from longboat.pipeline.measure import LayerCosts

#: the small GPT's pieces: embeddings, each block's attention half, then its MLP half three
#: times as costly, and the head; under every schedule here its measured split cuts a block
_FORWARD = (0.001, 0.005, 0.015, 0.005, 0.015, 0.005, 0.015, 0.03)
_CUT = LayerCosts(_FORWARD, tuple(2 * f for f in _FORWARD), (0,) * 8)

# -- the split for the schedule, on synthetic costs ---------------------------------------------


def _simulated(kind: str, ranks: int, m: int, virtual: int, f: list[float], b: list[float]):
    plan = schedules.build(kind, ranks, m, virtual)

    def score(bounds: list[int]) -> float:
        fs = [sum(f[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]
        bs = [sum(b[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1)]
        return plan.simulate(fs, bs).makespan

    return score


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("kind", "ranks", "virtual"),
    [("interleaved", 2, 2), ("1f1b", 3, 1), ("zb-h1", 2, 1), ("interleaved-zb", 2, 2)],
)
def test_the_split_for_the_schedule_is_the_fastest_the_simulator_finds(seed, kind, ranks, virtual):
    g = torch.Generator().manual_seed(seed)
    stages = ranks * virtual
    n = int(torch.randint(stages, 10, (1,), generator=g))
    f = (torch.rand(n, generator=g, dtype=torch.float64) * 0.05).tolist()
    b = [2 * x for x in f]
    score = _simulated(kind, ranks, 8, virtual, f, b)
    total = [x + y for x, y in zip(f, b, strict=True)]
    chosen = partition.measured(total, stages, score)
    best = min(score([0, *c, n]) for c in itertools.combinations(range(1, n), stages - 1))
    assert score(chosen) == pytest.approx(best, rel=1e-9)
    # never slower than the split with the smallest slowest stage, which it starts from
    assert score(chosen) <= score(partition.measured(total, stages))


def test_an_interleaved_split_balances_each_rank_not_each_stage():
    # the reference GPT's pieces, as measured at micro-batch 2 (ms, forward + backward):
    # embeddings, four blocks' attention and MLP halves, the head over the vocabulary
    total = [2.8, 24, 37, 24, 37, 24, 37, 24, 37, 72]
    f = [t / 3 for t in total]
    b = [2 * t / 3 for t in total]
    score = _simulated("interleaved", 2, 8, 2, f, b)
    smallest_slowest = partition.measured(total, 4)
    chosen = partition.measured(total, 4, score)
    assert chosen != smallest_slowest
    assert score(chosen) < 0.95 * score(smallest_slowest)
    rank_load = [sum(total[chosen[s] : chosen[s + 1]]) for s in range(4)]
    # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    assert rank_load[0] + rank_load[2] == pytest.approx(rank_load[1] + rank_load[3], rel=0.05)


def test_where_the_first_split_is_already_best_it_stays():
    # equal layers under 1F1B: the smallest slowest stage is as fast as any, and is kept
    total = [0.003] * 6
    score = _simulated("1f1b", 2, 4, 1, [0.001] * 6, [0.002] * 6)
    assert partition.measured(total, 2, score) == partition.measured(total, 2) == [0, 3, 6]


def test_beyond_the_exhaustive_limit_a_local_search_only_improves():
    g = torch.Generator().manual_seed(5)
    n, stages = 24, 4
    assert partition.EXHAUSTIVE < 2024  # C(23, 3) splits: searched locally
    f = (torch.rand(n, generator=g, dtype=torch.float64) * 0.05).tolist()
    b = [2 * x for x in f]
    score = _simulated("interleaved", 2, 8, 2, f, b)
    total = [x + y for x, y in zip(f, b, strict=True)]
    start = partition.measured(total, stages)
    chosen = partition.measured(total, stages, score)
    assert score(chosen) <= score(start)
    assert chosen[0] == 0 and chosen[-1] == n and all(x < y for x, y in itertools.pairwise(chosen))


# -- a block in two parts --------------------------------------------------------------------


def test_the_gpt_lists_its_blocks_halves_and_other_methods_cut_between_whole_blocks():
    model = test_pipeline._small_gpt()  # 3 blocks: 1 + 3 x 2 + 1 pieces
    assert len(layered.pieces(model)) == 8
    bounds, info = layered.plan(model, 2, "uniform")  # 5 layers: 3 + 2
    assert bounds == [0, 5, 8]
    assert info[0].describe().startswith("stage 0: layers 0-2 (Embedding, 2 _Block)")
    # equal pieces: the smallest slowest stage ends with a whole block
    costs = LayerCosts((0.001,) + (0.01,) * 6 + (0.02,), (0.0,) * 8, (0,) * 8)
    bounds, info = layered.plan(model, 2, "measured", costs)
    assert bounds == [0, 5, 8]  # 0.041 s against 0.04 s
    assert info[0].describe().startswith("stage 0: layers 0-2 (Embedding, 2 _Block)")
    # an MLP half three times the attention's: the boundary falls inside block 2 (layer 3)
    costs = LayerCosts(_CUT.forward_s, (0.0,) * 8, (0,) * 8)
    bounds, info = layered.plan(model, 2, "measured", costs)
    assert bounds == [0, 6, 8]  # 0.046 s against 0.045 s; by whole blocks 0.041 against 0.05
    assert (
        info[0].describe().startswith("stage 0: layers 0-3a (Embedding, 2 _Block, part of _Block)")
    )
    assert info[1].describe().startswith("stage 1: layers 3b-4 (part of _Block, LayerNorm)")


def test_a_stage_holding_a_whole_block_calls_it_once_and_a_cut_one_by_its_half():
    model = test_pipeline._small_gpt()
    calls: list[tuple[str, Any]] = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(
            lambda m, a, kw, i=i: calls.append((f"blocks.{i}", kw.get("part"))), with_kwargs=True
        )
    # stage 0: embeddings, block 0, block 1's attention; stage 1: the rest
    split, _ = layered.split(model, [0, 4, 8], [0, 1])
    x = torch.randint(0, 64, (2, 8))
    want = GPT.forward(test_pipeline._small_gpt(), x)
    got = split(split(x, stage=0), stage=1)
    assert torch.equal(got, want)
    assert calls == [
        ("blocks.0", None),
        ("blocks.1", "attention"),
        ("blocks.1", "mlp"),
        ("blocks.2", None),
    ]
    # held alone, a stage keeps its half of the block and gives the other half away
    model = test_pipeline._small_gpt()
    layered.split(model, [0, 4, 8], [0])
    held = [n for n, _ in model.named_parameters()]
    assert "blocks.1.attn.qkv.weight" in held and "blocks.1.ln1.weight" in held
    assert not any(n.startswith(("blocks.1.mlp", "blocks.1.ln2", "blocks.2")) for n in held)
    assert isinstance(model.blocks[2], layered.Elsewhere)  # away whole, as without parts


class _Leaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))

    def pipeline_layers(self) -> list[Any]:
        # the parts forget b: a stage holding part 0 alone would have nowhere to keep it
        return [(("a", "b"), self, ((("a",), self.a), ((), lambda x: self.b(x))))]


def test_parts_that_miss_a_parameter_are_refused_by_name():
    with pytest.raises(
        TypeError, match=r"pipeline_layers\(\)\[0\].*no part uses \['b.bias', 'b.weight'\]"
    ):
        layered.pieces(_Leaky())
    with pytest.raises(ValueError, match="a block's parts are"):
        test_pipeline._small_gpt().blocks[0](torch.zeros(1, 2, 32), part="attn")


# -- training through a cut block, against plain PyTorch --------------------------------------


#: pieces of equal cost but the head's: interleaved, the split for the schedule cuts blocks 0
#: and 1 (where _FORWARD's, for it, falls between whole blocks)
_EVEN = (0.001, *(0.012,) * 6, 0.03)


def _train_cut(cfg: dict[str, Any], steps: int, forward: tuple[float, ...]) -> dict[str, Any]:
    costs = LayerCosts(forward, tuple(2 * f for f in forward), (0,) * len(forward))
    # the margin off: what is tested here is training through a cut block, wherever the
    # simulator prefers one (test_a_cut_must_be_predicted_clearly_faster tests the margin)
    with (
        mock.patch.object(measure, "measure", lambda *a, **k: costs),
        mock.patch.object(layered, "CUT_MARGIN", 0.0),
    ):
        out = test_pipeline._train_gpt(cfg, steps)
    return out


@pytest.mark.parametrize(
    ("world", "extra", "forward"),
    [
        (2, {"mesh": {"pp": 2}}, _FORWARD),
        (
            2,
            {"mesh": {"pp": 2}, "pipeline": {"schedule": "interleaved", "virtual_stages": 2}},
            _EVEN,
        ),
        (2, {"mesh": {"pp": 2}, "pipeline": {"schedule": "zb-h1"}}, _FORWARD),
        (
            2,
            {"mesh": {"pp": 2}, "pipeline": {"schedule": "interleaved-zb", "virtual_stages": 2}},
            _EVEN,
        ),
        (4, {"mesh": {"pp": 2}, "strategy": "zero", "zero": {"stage": 3}}, _FORWARD),
        (4, {"mesh": {"pp": 2, "tp": 2}}, _FORWARD),
    ],
    ids=["1f1b", "interleaved", "zb-h1", "interleaved-zb", "zero3-dp2", "tp2"],
)
def test_a_block_cut_between_stages_trains_as_plain_pytorch(ranks, world, extra, forward):
    cfg = {
        **harness.QUIET,
        "gradient_clipping": 1.0,
        "batch": {"train_batch_size": 8, "gradient_accumulation_steps": 4},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        **extra,
    }
    results = ranks(world, _train_cut, cfg, 4, forward)
    dp = world // extra["mesh"]["pp"] // extra["mesh"].get("tp", 1)
    plain, model = test_pipeline._plain_gpt(4, 8 // (4 * dp))
    want = model.state_dict()
    # every rank's losses; with data parallelism each rank has its own samples, and the mean
    # over a stage's data-parallel ranks is the plain loss
    per_stage = world // dp
    for s in range(per_stage):
        mine = [results[s * dp + d]["losses"] for d in range(dp)]
        assert [sum(x) / dp for x in zip(*mine, strict=True)] == pytest.approx(plain, rel=1e-5)
    # some block's halves are on two stages, each under the user's names
    held = [set(r["held"]) for r in results]
    cut = [
        i
        for i in range(3)
        for h in held
        if f"blocks.{i}.attn.qkv.weight" in h and f"blocks.{i}.mlp.fc.weight" not in h
    ]
    assert cut, held
    assert any(f"blocks.{cut[0]}.mlp.fc.weight" in h for h in held)
    for r in results:
        got = {k: v for k, v in r["state"].items() if k in want}
        assert got and reference.max_rel_diff(got, {k: want[k] for k in got}) <= 1e-5


def test_layers_and_parts_listed_as_lists_work_as_tuples_and_others_are_refused():
    model = test_pipeline._small_gpt()
    listed = [
        [list(e[0]), e[1], *([[[list(pp), pf] for pp, pf in e[2]]] if len(e) == 3 else [])]
        for e in model.pipeline_layers()
    ]
    model.pipeline_layers = lambda: listed  # type: ignore[method-assign]
    assert [p.label(end=False) for p in layered.pieces(model)][:3] == ["0", "1", "1b"]
    model.pipeline_layers = lambda: [(("tok_emb",),)]  # type: ignore[method-assign]
    with pytest.raises(TypeError, match=r"pipeline_layers\(\)\[0\] must be"):
        layered.pieces(model)
    model.pipeline_layers = lambda: [(("blocks.0",), model.blocks[0], [("blocks.0.ln1",)])]  # type: ignore[method-assign]
    with pytest.raises(TypeError, match=r"part 0 must be"):
        layered.pieces(model)


def test_a_cut_must_be_predicted_clearly_faster_than_whole_layers():
    from longboat.models import reference_gpt

    # the reference GPT's pieces as in test_an_interleaved_split_balances_each_rank...
    total = [2.8, 24, 37, 24, 37, 24, 37, 24, 37, 72]
    costs = LayerCosts(
        tuple(t / 3 for t in total), tuple(2 * t / 3 for t in total), (0,) * len(total)
    )
    model = reference_gpt()

    def chosen(kind: str, virtual: int, margin: float) -> tuple[list[int], float]:
        plan = schedules.build(kind, 2, 8, virtual)

        def score(b: list[int]) -> float:
            return plan.simulate(*costs.stage_sums(b)).makespan

        with mock.patch.object(layered, "CUT_MARGIN", margin):
            bounds = layered.plan(model, 2 * virtual, None, costs, score)[0]
        return bounds, score(bounds)

    # 1F1B: the best cut is predicted under 5% faster than whole layers, which are kept
    cut, cut_step = chosen("1f1b", 1, 0.0)
    whole, whole_step = chosen("1f1b", 1, layered.CUT_MARGIN)
    assert set(cut) - {0, 1, 3, 5, 7, 9, 10}, "without the margin it cuts a block"
    assert set(whole) <= {0, 1, 3, 5, 7, 9, 10} and 0.95 < cut_step / whole_step < 1
    # interleaved: predicted 10% faster, the cut stays
    bounds, _ = chosen("interleaved", 2, layered.CUT_MARGIN)
    assert set(bounds) - {0, 1, 3, 5, 7, 9, 10}
