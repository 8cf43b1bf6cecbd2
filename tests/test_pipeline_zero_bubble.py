"""The zero-bubble schedules (``zb-h1``, ``interleaved-zb``) as data, without processes:
their action lists validated and simulated against their theory and against 1F1B and
interleaved; and the split backward they run ([Note: split backward]) against the unsplit one,
gradient for gradient. Training through stages against the plain loop is in
``test_pipeline.py`` (parametrized by schedule)."""

from __future__ import annotations

import copy
import typing

import pytest
import reference
import torch
from torch import nn

from longboat.config.sections_parallel import SPLIT_BACKWARD_SCHEDULES, PipelineConfig
from longboat.pipeline import schedules
from longboat.pipeline.schedules import Action, PipelineSchedule, ScheduleError
from longboat.pipeline.split_backward import backward_input

SIZES = [(p, m) for p in (1, 2, 3, 4) for m in range(p, 3 * p + 2)]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_zb_h1_meets_its_theory_and_idles_less_than_1f1b(p, m):
    zb = schedules.build("zb-h1", p, m)  # validates: complete, on the right ranks, no deadlock
    assert zb.split and not schedules.build("1f1b", p, m).split
    one = schedules.build("1f1b", p, m).simulate()
    t = zb.simulate()  # a backward of two forwards, split half and half
    for r, bubble in enumerate(t.bubble):
        assert bubble == pytest.approx(schedules.bubble_theory(p, m, kind="zb-h1"))
        assert bubble == pytest.approx(schedules.zero_bubble_theory(p, m, 1.0, 1.0, 1.0))
        if p > 1 and m >= 2 * p:
            assert bubble < one.bubble[r]
    # weight gradients cheaper than input gradients: the theory still holds
    uneven = zb.simulate(forward_cost=1.0, backward_cost=2.0, weight_cost=0.5)
    for bubble in uneven.bubble:
        assert bubble == pytest.approx(schedules.zero_bubble_theory(p, m, 1.0, 1.5, 0.5))
    # the most any rank holds is 1F1B's most (the first rank's p micro-batches)
    assert max(t.peak_in_flight) == max(one.peak_in_flight) == p
    assert zb.peak_held(0, lambda s: 1) == p


def test_zb_h1_order_sends_each_input_gradient_first_and_defers_weights():
    sched = schedules.build("zb-h1", 3, 6)
    assert sched.describe().splitlines() == [
        "zb-h1: 3 rank(s), 6 micro-batches",
        "  rank 0: F0 F1 F2 I0 W0 F3 I1 W1 F4 I2 W2 F5 I3 W3 I4 W4 I5 W5",
        "  rank 1: F0 F1 I0 F2 I1 W0 F3 I2 W1 F4 I3 W2 F5 I4 W3 I5 W4 W5",
        "  rank 2: F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 F4 I4 W2 F5 I5 W3 W4 W5",
    ]
    # an I sends upstream like a B; a W moves nothing
    sends, recvs = sched.messages(1)
    assert sorted(a.op for _, a in sends) == ["F"] * 6 + ["I"] * 6
    assert sorted(a.op for _, a in recvs) == ["F"] * 6 + ["I"] * 6


@pytest.mark.parametrize(
    ("p", "m", "v", "words"),
    [
        (3, 2, 1, ["zb-h1", "2 micro-batch(es) cannot fill 3", "at least 3"]),
        (2, 4, 2, ["zb-h1", "virtual stages", "interleaved"]),
    ],
)
def test_zb_h1_refusals(p, m, v, words):
    with pytest.raises(ScheduleError) as e:
        schedules.build("zb-h1", p, m, v)
    for w in words:
        assert w in str(e.value)


def test_split_schedules_are_validated_and_costed():
    good = schedules.build("zb-h1", 2, 2)
    # a W before its own I waits for ever
    assert good.actions[0] == tuple(
        Action(op, mb, 0) for op, mb in [("F", 0), ("F", 1), ("I", 0), ("W", 0), ("I", 1), ("W", 1)]
    )
    early = (
        tuple(
            Action(op, mb, 0)
            for op, mb in [("F", 0), ("W", 0), ("F", 1), ("I", 0), ("I", 1), ("W", 1)]
        ),
        good.actions[1],
    )
    with pytest.raises(ScheduleError, match="would deadlock: rank 0 waits in W0"):
        PipelineSchedule("zb-h1", 2, 2, 1, early).validate()
    # a split backward without its W never puts the weights' gradients in
    no_w = (tuple(a for a in good.actions[0] if a != Action("W", 1, 0)), good.actions[1])
    with pytest.raises(ScheduleError, match=r"no rank runs \[Action\(op='W', micro_batch=1"):
        PipelineSchedule("zb-h1", 2, 2, 1, no_w).validate()
    with pytest.raises(ValueError, match="exceed the backward costs"):
        good.simulate(backward_cost=2.0, weight_cost=3.0)
    with pytest.raises(ValueError, match=r"W = 2\.0 > I = 1\.0"):
        schedules.zero_bubble_theory(2, 4, 1.0, 1.0, 2.0)


INTERLEAVED_SIZES = [(p, m, v) for p in (2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize(("p", "m", "v"), INTERLEAVED_SIZES)
def test_interleaved_zb_meets_its_theory_and_idles_less_than_interleaved(p, m, v):
    zb = schedules.build("interleaved-zb", p, m, v)  # validated: complete, ordered, no deadlock
    plain = schedules.build("interleaved", p, m, v)
    assert zb.split
    # an I where interleaved ran each B, in its order: the F's and the messages do not move
    unsplit = [
        [Action("B", a.micro_batch, a.stage) if a.op == "I" else a for a in acts if a.op != "W"]
        for acts in zb.actions
    ]
    assert unsplit == [list(acts) for acts in plain.actions]
    one, t = plain.simulate(), zb.simulate()
    for r, bubble in enumerate(t.bubble):
        assert bubble == pytest.approx(schedules.bubble_theory(p, m, v, kind="interleaved-zb"))
        assert bubble < one.bubble[r]
    uneven = zb.simulate(forward_cost=1.0, backward_cost=2.0, weight_cost=0.5)
    for bubble in uneven.bubble:
        assert bubble == pytest.approx(schedules.zero_bubble_theory(p, m, 1.0, 1.5, 0.5, virtual=v))
    # rank r defers r W's: it holds at most r stages more than interleaved, and no rank more
    # than interleaved's first
    for r in range(p):
        assert t.peak_in_flight[r] <= one.peak_in_flight[r] + r
    assert max(t.peak_in_flight) == max(one.peak_in_flight)


def test_interleaved_zb_order_defers_each_rank_s_weights_by_its_rank():
    sched = schedules.build("interleaved-zb", 2, 4, 2)
    assert sched.describe().splitlines() == [
        "interleaved-zb: 2 rank(s) x 2 virtual stages, 4 micro-batches",
        "  rank 0: F0.0 F1.0 F0.2 F1.2 F2.0 I0.2 W0.2 F3.0 I1.2 W1.2 F2.2 I0.0 W0.0 F3.2 I1.0 "
        "W1.0 I2.2 W2.2 I3.2 W3.2 I2.0 W2.0 I3.0 W3.0",
        "  rank 1: F0.1 F1.1 F0.3 I0.3 F1.3 I1.3 W0.3 F2.1 I0.1 W1.3 F3.1 I1.1 W0.1 F2.3 I2.3 "
        "W1.1 F3.3 I3.3 W2.3 I2.1 W3.3 I3.1 W2.1 W3.1",
    ]


@pytest.mark.parametrize(
    ("p", "m", "words"),
    [
        (2, 3, ["interleaved", "groups of 2", "multiple of 2"]),
        (1, 2, ["at least 2 pipeline ranks"]),
    ],
)
def test_interleaved_zb_refusals(p, m, words):
    with pytest.raises(ScheduleError) as e:
        schedules.build("interleaved-zb", p, m, 2)
    for w in words:
        assert w in str(e.value)


def test_the_split_schedules_are_the_ones_the_config_calls_split():
    kinds = typing.get_args(PipelineConfig.model_fields["schedule"].annotation)
    assert set(schedules.SCHEDULES) == set(kinds)
    split = {k for k in kinds if schedules.build(k, 2, 4, 2 if "interleaved" in k else 1).split}
    assert split == set(schedules.SPLIT_KINDS) == set(SPLIT_BACKWARD_SCHEDULES)


# -- the split backward ------------------------------------------------------------------------


def _reused() -> nn.Module:
    return reference.ReusedNet()


def _count_runs(out: torch.Tensor, kind: str, runs: list[int]) -> None:
    """Count, in ``runs``, how often each node of type ``kind`` below ``out`` runs."""
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == kind:
            i = len(runs)
            runs.append(0)

            def hook(grads: tuple, i: int = i) -> None:
                runs[i] += 1

            node.register_prehook(hook)
        todo += [child for child, _ in node.next_functions]


@pytest.mark.parametrize(
    ("build", "input_grad"),
    [
        (reference.chain_net, True),  # frozen, never-used and sometimes-used parameters
        (_reused, True),  # one weight at three depths of the stage
        (reference.chain_net, False),  # a first stage: nothing to send, W is everything
    ],
    ids=["chain", "reused", "first-stage"],
)
def test_split_backward_equals_the_unsplit_one(build, input_grad):
    torch.manual_seed(0)
    whole = build()
    split = copy.deepcopy(whole)
    fired: dict[str, dict[str, int]] = {"whole": {}, "split": {}}
    for which, model in (("whole", whole), ("split", split)):
        for name, p in model.named_parameters():  # what a data-parallel strategy listens to
            if p.requires_grad:

                def count(_: torch.Tensor, name: str = name, seen=fired[which]) -> None:
                    seen[name] = seen.get(name, 0) + 1

                p.register_post_accumulate_grad_hook(count)
    g = torch.Generator().manual_seed(1)
    passes = []
    tanh_runs: list[int] = []  # the input path's activations, whose backward has no weight
    for _ in range(3):  # three micro-batches: every I first, then the W's (gradients accumulate)
        x = torch.randn(4, 12, generator=g)
        xa, xb = x.clone().requires_grad_(input_grad), x.clone().requires_grad_(input_grad)
        out_a, out_b = whole(xa), split(xb)
        _count_runs(out_b, "TanhBackward0", tanh_runs)
        grad = torch.randn(out_a.shape, generator=g)
        torch.autograd.backward(out_a, grad)
        found, weights = backward_input(out_b, grad, [xb], list(split.parameters()))
        if input_grad:
            assert found[0] is not None and torch.equal(found[0], xa.grad)
        else:
            assert found == [None]
        assert all(p.grad is None for p in split.parameters()), "I leaves the weights alone"
        passes.append(weights)
    runs_in_i = sum(tanh_runs)
    for weights in passes:
        weights()
    # I runs the input's path once (a first stage has none to run); W replays only the branches
    # to parameters, so what lies on the input's path alone ran once in all (but between two
    # uses of one weight, which W replays together)
    assert runs_in_i == (len(tanh_runs) if input_grad else 0)
    if build is not _reused:
        assert sum(tanh_runs) == len(tanh_runs)
    mine = dict(split.named_parameters())
    for name, p in whole.named_parameters():
        if p.grad is None:  # frozen, or never used
            assert mine[name].grad is None, name
            continue
        assert torch.equal(mine[name].grad, p.grad), name
    # one accumulation per micro-batch that used a parameter, as in the unsplit backward
    assert fired["split"] == fired["whole"]


def test_a_stage_that_passes_its_input_on_hands_back_the_gradient_it_got():
    # A stage whose only layer skipped its branch on this micro-batch returns its input: the
    # output has no grad_fn, and its input's gradient is the one that came back. It used to
    # be None, and the runtime sent zeros to the stage before.
    x = torch.randn(4, 6).requires_grad_(True)
    grad = torch.randn(4, 6)
    found, weights = backward_input(x, grad, [x], [])
    assert found[0] is grad
    weights()  # nothing to do, and no error
