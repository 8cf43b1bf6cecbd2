"""The same DeepSpeed scripts under real DeepSpeed 0.19.8 (torchrun, 2 ranks, gloo, CPU) and
under ``longboat run -n 2`` with ``import longboat.deepspeed as deepspeed``: loss by loss, lr by
lr, and across a save and a resume, at ZeRO stages 0 to 3 (stage 3 built under
``deepspeed.zero.Init`` and read through ``deepspeed.zero.GatheredParameters``;
tests/launch_scripts/ds_side_by_side.py holds the scripts).

Real DeepSpeed is found and both sides are started by tests/ds_compare.py (without DeepSpeed
installed these tests skip, saying how to install it). Each side runs once for the whole module;
both start together.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ds_compare import close as _close
from ds_compare import run_both

SCRIPT = Path(__file__).parent / "launch_scripts" / "ds_side_by_side.py"

pytestmark = pytest.mark.deepspeed_compare


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    return run_both(SCRIPT, tmp_path_factory)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_loop_with_warmup_lr_gives_deepspeeds_losses_and_lrs(runs, stage):
    for rank in range(2):
        ds = runs["deepspeed"][rank][f"stage{stage}"]
        lb = runs["longboat"][rank][f"stage{stage}"]
        _close(lb["losses"], ds["losses"])
        assert [lr for (lr,) in lb["lrs"]] == pytest.approx([lr for (lr,) in ds["lrs"]])
        for key in ("global_steps", "stage", "batch", "boundaries", "samples"):
            assert lb[key] == ds[key], key
        for a, b in zip(lb["params"], ds["params"], strict=True):
            _close(a, b)
        # read through GatheredParameters on rank 0 only, before and after training
        weights = lb["weight_on_rank0"], ds["weight_on_rank0"]
        if rank == 0:
            for a, b in zip(*weights, strict=True):
                _close(a, b)
        else:
            assert weights == ([None, None], [None, None])
        if stage == 0:  # DeepSpeed reports no norm at stage 0; longboat the one it clipped by
            assert ds["norms"] == [None] * len(ds["norms"])
            ds = runs["deepspeed"][rank]["stage1"]
        assert (lb["norms"][0], ds["norms"][0]) == (None, None)  # before the first step
        _close(lb["norms"][1:], ds["norms"][1:])


@pytest.mark.parametrize("key", ["resume", "resume3"])
def test_save_and_resume_with_client_state_continue_as_deepspeed_does(runs, key):
    for rank in range(2):
        ds = runs["deepspeed"][rank][key]
        lb = runs["longboat"][rank][key]
        for side in (ds, lb):  # a resumed run is the uninterrupted one, in each framework
            # a fresh engine has no norm before its first step, in both
            norms = side["resumed"].pop("norms"), side["after"].pop("norms")
            assert norms[0][0] is None and norms[0][1:] == norms[1][1:]
            assert side["resumed"] == side["after"]
            assert side["params_resumed"] == side["params_after"]
            assert side["loaded"] and side["client"] == {"epoch": 3, "seen": 6}
        for part in ("before", "after"):
            _close(lb[part]["losses"], ds[part]["losses"])
            assert [lr for (lr,) in lb[part]["lrs"]] == pytest.approx(
                [lr for (lr,) in ds[part]["lrs"]]
            )
            assert lb[part]["global_steps"] == ds[part]["global_steps"]
        for a, b in zip(lb["params_after"], ds["params_after"], strict=True):
            _close(a, b)


def test_a_loop_on_comm_accelerator_and_repeating_loader_matches(runs):
    for rank in range(2):
        ds = runs["deepspeed"][rank]["comm"]
        lb = runs["longboat"][rank]["comm"]
        assert lb["device"] == ds["device"] == "cpu"
        assert lb["steps"] == ds["steps"] == 30
        _close(lb["mean_losses"], ds["mean_losses"])
