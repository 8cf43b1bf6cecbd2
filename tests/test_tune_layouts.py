"""``longboat tune`` over pipeline and tensor-parallel layouts: searched where the model can take
them, planned (every stage) and predicted with the schedule's bubble and the tensor-parallel
collectives, refused in the config's or the pipeline's own words, measured on the samples a run
would give each rank, and a chosen layout written as a config that loads. No time is asserted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_tune import RATES, FakeRunner, _fake_planner, _fake_work

from longboat.bench.models import resolve_model
from longboat.bench.runner import BenchSettings, run_bench
from longboat.config import load_config
from longboat.tune import output
from longboat.tune.cost import pipeline_stretch
from longboat.tune.layout import Layout
from longboat.tune.planning import layouts
from longboat.tune.search import TuneSettings, search
from longboat.tune.space import build_space

TINY = {"model": "tiny-gpt", "seq_len": 16}


def test_layouts_are_those_the_model_can_take() -> None:
    gpt = resolve_model("tiny-gpt", 16).build
    found, notes = layouts(gpt, 2)
    assert found == [
        Layout(),
        Layout(1, 2),
        Layout(2, 1, "1f1b"),
        Layout(2, 1, "zb-h1"),
    ]
    assert not notes
    # At 4 ranks every divisor, and the products that the world holds.
    four, _ = layouts(gpt, 4, schedules=("1f1b",))
    assert {(x.pp, x.tp) for x in four} == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}
    # The CNN neither lists its layers nor has a tensor-parallel plan: not searched, and why.
    cnn = resolve_model("digits-cnn").build
    found, notes = layouts(cnn, 2)
    assert found == [Layout()]
    assert any("mesh.pp: not searched" in n and "DigitsCNN" in n for n in notes)
    assert any("mesh.tp: not searched" in n and "tensor_parallel.plan" in n for n in notes)
    # Degrees named are tried whatever the model says (what the engine refuses is recorded).
    named, _ = layouts(cnn, 2, pp=(2,), tp=(1,), schedules=("1f1b",))
    assert named == [Layout(), Layout(2, 1, "1f1b")]


def test_pp_and_tp_candidates_are_planned_predicted_and_refused_in_their_words(
    tmp_path: Path,
) -> None:
    settings = TuneSettings(
        **TINY,
        world_size=2,
        global_batch=8,
        micro_sizes=(4, 8),
        buckets_mb=(25.0,),
        recompute=False,
        pp=(1, 2),
        tp=(1, 2),
        top=None,  # every candidate that fits, through the fake bench
    )
    runner = FakeRunner({"pp2 zb-h1 replicate m4x2": 0.5})
    result = search(settings, rates=RATES, runner=runner)
    rows = {o.name: o for o in result.outcomes}
    for name in ("pp2 1f1b replicate m4x2", "pp2 zb-h1 replicate m4x2", "tp2 replicate m4x2"):
        o = rows[name]
        assert o.planned is not None and o.prediction is not None, (name, o.reason)
        assert o.planned.peak > 0
    # A pipeline candidate's peak is its highest stage's, as longboat plan plans each stage.
    from longboat.plan.planner import make_plan
    from longboat.tune.target import plan_target

    staged = rows["pp2 1f1b replicate m4x2"]
    assert staged.candidate is not None and staged.planned is not None
    plan = make_plan(
        plan_target(resolve_model("tiny-gpt", 16)),
        staged.candidate.config,
        2,
        4,
        strategies=("replicate",),
    )
    assert len(plan.strategies) == 2
    assert staged.planned.peak == max(r.peak for r in plan.strategies)
    # The bubble is the schedule simulator's: 1F1B idles more than ZB-H1 at 2 micro-batches.
    for schedule in ("1f1b", "zb-h1"):
        p = rows[f"pp2 {schedule} replicate m4x2"].prediction
        assert p is not None
        busy = p.compute_s + p.overhead_s
        assert p.bubble_s == pytest.approx((pipeline_stretch(schedule, 2, 2) - 1) * busy)
    assert pipeline_stretch("1f1b", 2, 2) > pipeline_stretch("zb-h1", 2, 2) > 1
    # Tensor parallelism's collectives are the planner's, and in the communication term.
    tp = rows["tp2 replicate m4x2"]
    assert tp.planned is not None and tp.prediction is not None
    assert any(k.startswith("tp ") for k in tp.planned.comm_bytes)
    assert tp.prediction.comm_s > 0
    # Refused with their own words: one micro-batch cannot fill a 2-stage 1F1B (the pipeline's
    # check), 2 x 2 ranks do not lay out on 2 (the mesh's).
    refused = rows["pp2 1f1b replicate m8"]
    assert refused.status == "invalid" and "pipeline.schedule" in refused.reason
    both = [o for n, o in rows.items() if n.startswith("pp2 1f1b tp2")]
    assert both and all(o.status == "invalid" for o in both)
    assert all("mesh" in o.reason and "2" in o.reason for o in both)
    # A pipeline candidate chosen is written as a config that loads, with its layout.
    assert result.winner == "pp2 zb-h1 replicate m4x2" and result.winner in runner.launched
    toml, _, _ = output.write(result.outcome(result.winner).mapping, tmp_path / "t.toml", [])
    cfg = load_config(toml)
    assert (cfg.mesh.pp, cfg.pipeline.schedule) == (2, "zb-h1")
    assert cfg.batch.gradient_accumulation_steps == 2


def test_pp_and_tp_candidates_measure_the_samples_a_plain_loop_trains() -> None:
    # The bench gives each rank its data-parallel share: the two pipeline stages (or two
    # tensor-parallel ranks) take the same samples, so every layout's losses are those of a
    # plain loop on the whole batch.
    spec = resolve_model("tiny-gpt", 16)
    space = build_space(
        2, 8, micro_sizes=(4,), buckets_mb=(25.0,), layouts=[Layout(), Layout(2), Layout(1, 2)]
    )
    sides = {"config:" + c.name: c.mapping for c in space.candidates if c.strategy == "replicate"}
    assert len(sides) == 3
    steps = 2
    s = BenchSettings(
        model="tiny-gpt",
        strategies=(),
        peers=(),
        world_sizes=(2,),
        micro_batch=4,
        seq_len=16,
        warmup=0,
        steps=steps,
        memory=False,
        configs=sides,
    )
    rows = {r["side"]: r for r in run_bench(s)["rows"]}
    # The plain loop: the same weights and batches, AdamW at the bench's rate.
    torch.manual_seed(s.seed)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr)
    gen = torch.Generator().manual_seed(s.seed)
    plain = []
    for _ in range(steps):
        batch = spec.batch(8, gen)
        loss = spec.loss(model(*batch[:-1]), batch[-1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain.append(loss.item())
    for side in sides:
        assert rows[side]["losses"] == pytest.approx(plain, rel=1e-5), side


def test_a_candidate_the_planner_cannot_run_says_so_and_is_not_launched() -> None:
    def planner(c: Any) -> Any:
        if c.layout.pp > 1:
            raise RuntimeError("no fake kernel for this operator")
        return _fake_planner(c)

    runner = FakeRunner()
    settings = TuneSettings(
        **TINY, world_size=2, global_batch=8, buckets_mb=(25.0,), pp=(1, 2), tp=(1,), top=None
    )
    result = search(settings, planner=planner, work_of=_fake_work, rates=RATES, runner=runner)
    staged = [o for o in result.outcomes if o.name.startswith("pp2") and o.candidate is not None]
    assert staged and all(o.status == "unplanned" for o in staged)
    assert all(
        o.reason == "the planner could not plan it: RuntimeError: no fake kernel for this operator"
        for o in staged
    )
    assert runner.launched and not any(x.startswith("pp2") for x in runner.launched)


def test_a_pipeline_candidates_peak_is_its_heaviest_stages_when_that_is_not_the_first() -> None:
    # A vocabulary large beside the blocks: the last stage holds the head, its logits and their
    # gradient, and peaks above stage 0 (the embedding). A planner that simulated stage 0 only
    # would report stage 0's peak and let the candidate fit a budget the last stage exceeds.
    from longboat.engine import resolve_mesh
    from longboat.plan import resolve
    from longboat.plan.planner import OPTIMIZERS
    from longboat.plan.simulate import simulate
    from longboat.plan.stages import each_stage
    from longboat.tune.planning import planner_for
    from longboat.tune.space import Candidate

    adamw = OPTIMIZERS["adamw"]
    args = {"vocab_size": 4096, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16}
    target = resolve("gpt", args, seq_len=16)
    mapping = {
        "strategy": "replicate",
        "mesh": {"pp": 2},
        "pipeline": {"schedule": "1f1b", "partition": "uniform"},
        "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 2},
    }
    cfg = load_config(mapping)
    candidate = Candidate(
        "replicate", 4, 2, 25.0, (), "fp32", mapping, cfg, layout=Layout(2, 1, "1f1b")
    )
    planned = planner_for(target, 2)(candidate)
    mesh = resolve_mesh(cfg, 2)
    stages = each_stage(
        mesh, lambda rank, shapes=None: simulate(target, cfg, 2, 4, adamw, rank, shapes)
    )
    assert [s.stages for s in stages] and stages[1].peak > stages[0].peak
    # (the planner's run differs by a few bytes of its own config: progress off)
    assert planned.peak == pytest.approx(stages[1].peak, rel=1e-4)
    assert planned.peak > stages[0].peak * (1 + 1e-3)
