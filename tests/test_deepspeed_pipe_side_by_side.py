"""DeepSpeed's pipeline tutorial under real DeepSpeed 0.19.8 (torchrun, 2 ranks = 2 stages, gloo,
CPU) and under ``longboat run -n 2`` with the imports changed: which layers each stage holds and
their starting weights, every ``train_batch()`` loss, lr and sample count, ``eval_batch()``, and a
``save_checkpoint``/``load_checkpoint`` resume (tests/launch_scripts/ds_pipe_side_by_side.py
holds the script; tests/ds_compare.py starts both sides together, once for the module).

DeepSpeed's pipeline engine runs on the CPU with gloo at 0.19.8, so these compare against it
directly. Its ``PipelineModule`` builds each stage's layers in its constructor from the random
state the script left, after building every layer once to count parameters for
``partition_method='parameters'`` ([Note: DeepSpeed layer initialisation] in
``longboat/deepspeed/pipe.py``): the weights each stage starts from are compared first.
Two things differ, on DeepSpeed's side, and neither is copied. ``eval_batch()`` returns a 0-d
tensor on the last stage and a tensor of shape ``(1,)`` on the others (the buffer it broadcast
into), where longboat returns a 0-d tensor on every stage (``float()`` or ``.item()`` reads
both). And its pipeline engine clips gradients by the norm of the first stage's gradients alone:
``clip_fp32_gradients`` (``deepspeed/runtime/engine.py``) calls ``clip_grad_norm_(...,
mpu=self.mpu)`` (``deepspeed/runtime/utils.py``), which counts a parameter's norm only on
model-parallel rank 0 unless the parameter is marked model-parallel, and a pipeline's
model-parallel group is its stages, whose parameters are not so marked; the other stages' norms
are added as zeros and every stage is scaled by stage 0's norm. longboat clips by the norm of
every stage's gradients, as ``torch.nn.utils.clip_grad_norm_`` over the whole model does, so the
script turns clipping off (``gradient_clipping: 0``; DeepSpeed 0.19.8's default is 1.0); with it
on, the two part from the first step whose norm is above the limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ds_compare import close, run_both

SCRIPT = Path(__file__).parent / "launch_scripts" / "ds_pipe_side_by_side.py"
SCENARIOS = ["parameters", "uniform", "type:Linear", "tied"]

pytestmark = pytest.mark.deepspeed_compare


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return run_both(SCRIPT, tmp_path_factory)


def _named(weights: dict[str, list[float]]) -> dict[str, list[float]]:
    """A tied module's weights under one name: DeepSpeed keeps them in ``tied_modules.KEY``,
    longboat in ``tied.KEY``."""
    return {n.replace("tied_modules.", "tied.", 1): w for n, w in weights.items()}


def _same_weights(a: dict[str, list[float]], b: dict[str, list[float]]) -> None:
    a, b = _named(a), _named(b)
    assert sorted(a) == sorted(b)
    for name in a:
        close(a[name], b[name])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_each_stage_holds_deepspeeds_layers_and_starts_from_its_weights(runs, scenario):
    for rank in range(2):
        _same_weights(
            runs["longboat"][rank][scenario]["start"], runs["deepspeed"][rank][scenario]["start"]
        )
    if scenario == "tied":  # the tied map is on both stages, equal
        stage0, stage1 = (runs["deepspeed"][r]["tied"]["start"] for r in range(2))
        assert stage0["tied_modules.io.weight"] == stage1["tied_modules.io.weight"]


def test_the_three_partition_methods_split_the_layers_as_deepspeeds_do(runs):
    for rank in range(2):
        for method in SCENARIOS:
            ds, lb = runs["deepspeed"][rank][method], runs["longboat"][rank][method]
            assert lb["bounds"] == ds["bounds"], method
    bounds = {tuple(runs["deepspeed"][0][m]["bounds"]) for m in SCENARIOS[:3]}
    assert len(bounds) == 3, bounds  # else the test could not tell them apart


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_train_batch_gives_deepspeeds_losses_lrs_and_weights(runs, scenario):
    for rank in range(2):  # train_batch() returns the loss on every stage, in both
        ds = runs["deepspeed"][rank][scenario]
        lb = runs["longboat"][rank][scenario]
        close(lb["losses"], ds["losses"])
        assert lb["shapes"] == ds["shapes"] == [[]] * 5
        assert [lr for (lr,) in lb["lrs"]] == pytest.approx([lr for (lr,) in ds["lrs"]])
        for key in ("samples", "global_steps", "batch"):
            assert lb[key] == ds[key], key
        _same_weights(lb["end"], ds["end"])
        assert lb["norms"] == ds["norms"] == [None] * 5  # no clipping: no norm, in both


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_eval_batch_gives_deepspeeds_loss_on_every_stage(runs, scenario):
    for rank in range(2):
        ds = runs["deepspeed"][rank][scenario]["eval"]
        lb = runs["longboat"][rank][scenario]["eval"]
        close([lb["loss"]], [ds["loss"]])
        assert lb["training"] == ds["training"] == [False, True]  # eval mode until train_batch
        # DeepSpeed's shape differs by stage (see the module's docstring); longboat's does not
        assert ds["shape"] == ([1] if rank == 0 else [])
        assert lb["shape"] == []


def test_parameters_and_type_partitions_are_deepspeeds_at_any_number_of_stages(runs):
    assert runs["longboat"][0]["balanced"] == runs["deepspeed"][0]["balanced"]


def test_a_resumed_pipeline_continues_as_deepspeeds_does(runs):
    for rank in range(2):
        ds = runs["deepspeed"][rank]["resume"]
        lb = runs["longboat"][rank]["resume"]
        for side in (ds, lb):  # resumed = uninterrupted, in each framework
            assert side["loaded"] and side["client"] == {"epoch": 1, "seen": 24}
            assert side["resumed"] == side["after"] and side["same_weights"]
        for part in ("before", "after"):
            close(lb[part]["losses"], ds[part]["losses"])
            assert [lr for (lr,) in lb[part]["lrs"]] == pytest.approx(
                [lr for (lr,) in ds[part]["lrs"]]
            )
            assert lb[part]["global_steps"] == ds[part]["global_steps"]
