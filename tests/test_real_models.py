"""Models people train, against the plain PyTorch loop of ``reference.py``: transformers' GPT-2,
Llama (grouped-query attention), BERT and ALBERT (masked LM, tied decoders; ALBERT's one layer
runs at every depth), T5 (encoder-decoder, one embedding shared three ways) and Mixtral (routed
experts in fused weights), a ResNet (BatchNorm buffers) and an LSTM language model (tied head).

Each trains under every data-parallel strategy at 2 ranks, ZeRO-3 and hybrid sharding at 4, and
(GPT-2, Llama) tensor parallelism with the built-in plans and pipeline stages with the built-in
layers, with the settings a user gets by default (ZeRO-3's units: the blocks the model declares,
else modules of a million parameters). Every micro-batch's loss on every rank, then parameters,
buffers and optimizer state, must equal the plain loop's within 1e-5 relative. Few steps keep
the matrix quick; the plain run of a model is shared by every case that gave each rank the same
samples.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import harness
import pytest
import reference
import torch

import longboat

STEPS = 3
GLOBAL_BATCH = 8
TOL = 1e-5

# SGD with momentum for the sequence models: Adam divides each gradient by its own running
# magnitude, so an element whose gradient is tiny (some of the LSTM's input weights: 1e-7)
# turns the reduction's rounding, which is relative to the largest gradient, into a visible
# step (6e-5 of the LSTM's weights after 3 steps). Clipping makes every case depend on the
# gradient norm summed over shards.
RECIPES = {
    name: reference.Recipe(model=name, optimizer="sgd", clip=1.0)
    for name in ("gpt2", "llama", "bert", "t5", "mixtral", "albert", "lstm")
}
RECIPES["resnet"] = reference.Recipe(model="resnet", optimizer="adamw")

ZERO3 = {"strategy": "zero", "zero": {"stage": 3}}
STRATEGIES: dict[str, dict[str, Any]] = {
    "replicate": {"strategy": "replicate"},
    "zero1": {"strategy": "zero", "zero": {"stage": 1}},
    "zero2": {"strategy": "zero", "zero": {"stage": 2}},
    "zero3": ZERO3,
    # ZeRO-3 within each pair of ranks, the pairs replicas of each other
    "hybrid": {**ZERO3, "mesh": {"dp_replicate": 2, "dp_shard": 2}},
    "tp": {"mesh": {"tp": 2}},  # the built-in plan the model's family matches
}

# (strategy, ranks, micro-batches per step); two micro-batches where it changes what a strategy
# does (ZeRO-2 and -3 reduce or keep gradients between them)
CASES = [
    ("replicate", 2, 1),
    ("zero1", 2, 1),
    ("zero2", 2, 2),
    ("zero3", 2, 2),
    ("zero3", 4, 1),
    ("hybrid", 4, 2),
]
MATRIX = [(model, *case) for model in RECIPES for case in CASES] + [
    ("gpt2", "tp", 2, 2),
    ("llama", "tp", 2, 2),
]


@functools.cache
def _plain(recipe: reference.Recipe, order: tuple) -> reference.PlainRun:
    return reference.plain_train(recipe, harness.data_for(recipe, GLOBAL_BATCH * STEPS), order)


@pytest.mark.parametrize(
    ("model", "strategy", "world", "accum"),
    MATRIX,
    ids=[f"{m}-{s}-{w}ranks" for m, s, w, _ in MATRIX],
)
def test_real_model_equals_plain_pytorch(ranks, model, strategy, world, accum):
    recipe = RECIPES[model]
    cfg = STRATEGIES[strategy]
    tp = cfg.get("mesh", {}).get("tp", 1)
    micro = GLOBAL_BATCH // (world // tp * accum)
    results = ranks(
        world, harness.train, recipe, harness.config(cfg, recipe, GLOBAL_BATCH, micro), STEPS
    )
    # Tensor-parallel peers see the same samples: the plain loop replays one of each group.
    order = harness.order_of(results[::tp])
    assert all(harness.order_of(results[r::tp]) == order for r in range(tp))
    seen = [i for step in order for micro_ids in step for ids in micro_ids for i in ids]
    assert len(seen) == len(set(seen)) == GLOBAL_BATCH * STEPS, "each sample once"
    plain = _plain(recipe, tuple(tuple(tuple(map(tuple, m)) for m in s) for s in order))
    if tp > 1:  # every rank's loss against its data-parallel group's
        losses = [[[m[r // tp] for r in range(world)] for m in s] for s in plain.losses]
        plain = dataclasses.replace(plain, losses=losses)
        # the plan divided the layers: optimizer pieces are this rank's slices
        assert any(piece[6] is not None for piece in results[0]["optim"]["pieces"])
    harness.compare(results, plain, TOL)
    if model == "albert" and cfg is ZERO3:
        # The shared layer (1.3M parameters) is a unit of its own, which runs at every depth.
        layer = "albert.encoder.albert_layer_groups.0.albert_layers.0"
        assert any(tag.endswith(f": {layer}") for tag in results[0]["units"]), results[0]["units"]


def test_some_experts_get_no_tokens_in_a_micro_batch():
    """The Mixtral cases cover experts that a micro-batch does not route to: their rows of the
    fused expert weights get an exactly zero gradient from it, and tokens from others."""
    recipe = RECIPES["mixtral"]
    model, _, _ = recipe.build()
    data = harness.data_for(recipe, GLOBAL_BATCH * STEPS)
    experts = model.model.layers[0].mlp.experts.gate_up_proj  # [experts, 2 x intermediate, d]
    idle = []
    for first in range(0, len(data), 2):  # two samples: ZeRO-2's and -3's micro-batch at 2 ranks
        _, *batch = data[first : first + 2]
        model.zero_grad(set_to_none=True)
        reference.forward_loss(model, batch).backward()
        idle.append(int((experts.grad.flatten(1).abs().amax(1) == 0).sum()))
    assert any(idle), "every expert got tokens in every micro-batch"
    assert not all(idle)


# -- pipeline stages -----------------------------------------------------------------------------
# The pipeline owns the step (engine.train_step runs its micro-batches through the stages), so
# these cases train through train_step, and compare the stages together: the last stage's loss
# of every micro-batch, every rank's mean, the parameters of all stages (a weight tied across
# them, GPT-2's embedding and head, equal on both) and the optimizer state. Every rank builds
# the model from the same seed: a stage's layers are those of the rank that holds them.

PIPELINE = {"mesh": {"pp": 2}}  # the default schedule (1F1B) and partition


def _train_stages(recipe: reference.Recipe, cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    model, opt, _ = recipe.build()
    engine = longboat.initialize(model, opt, cfg)
    ids: list[list[int]] = []  # per micro-batch, where the loss is computed (the last stage)
    losses: list[float] = []

    def loss_fn(out: Any, micro: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = reference.loss_of(out, micro[-1])
        ids.append(micro[0].tolist())
        losses.append(float(loss.detach()))
        return loss

    data = harness.data_for(recipe, engine.batch.train_batch_size * steps)
    steps_ids, means = [], []
    for batch in engine.loader(data, per_step=True):  # (sample ids, inputs..., targets)
        steps_ids.append(batch[0].tolist())
        means.append(engine.train_step(batch, loss_fn, inputs=lambda mb: tuple(mb[1:-1])))
        if engine.global_step == steps:
            break
    out = {
        "steps": steps_ids,
        "ids": ids,
        "losses": losses,
        "means": means,
        "state": {k: v.detach().clone() for k, v in engine.state_dict().items()},
        "optim": harness.optimizer_pieces(engine),
    }
    engine.close()
    return out


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_real_model_in_pipeline_stages_equals_plain_pytorch(ranks, model):
    recipe, accum = RECIPES[model], 2
    cfg = harness.config(PIPELINE, recipe, GLOBAL_BATCH, GLOBAL_BATCH // accum)
    first, last = ranks(2, _train_stages, recipe, cfg, STEPS)
    assert first["steps"] == last["steps"] and not first["ids"], "one data-parallel rank"
    micro = [last["ids"][i : i + accum] for i in range(0, len(last["ids"]), accum)]
    assert [[i for ids in m for i in ids] for m in micro] == last["steps"], "in order"
    plain = _plain(recipe, tuple(tuple((tuple(ids),) for ids in step) for step in micro))
    want = [loss for step in plain.losses for (loss,) in step]
    assert last["losses"] == pytest.approx(want, rel=TOL)
    means = [sum(m[0] for m in step) / accum for step in plain.losses]
    assert first["means"] == last["means"] == pytest.approx(means, rel=TOL)
    state = {**first["state"], **last["state"]}
    for k in first["state"].keys() & last["state"].keys():  # tied across the stages
        assert torch.equal(first["state"][k], last["state"][k]), k
    assert reference.max_rel_diff(state, plain.state) <= TOL
    optim = harness.assemble([first, last])
    assert optim.keys() == plain.optim.keys()
    for name, st in plain.optim.items():
        buf = {name: st["momentum_buffer"]}
        assert reference.max_rel_diff({name: optim[name]["momentum_buffer"]}, buf) <= TOL
