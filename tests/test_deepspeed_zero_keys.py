"""Every ``zero_optimization`` key DeepSpeed 0.19.8 accepts is accepted here or refused by name
with the reason: none is taken for a misspelling ([Note: DeepSpeed keys])."""

from __future__ import annotations

import logging
import sys

import pytest

from longboat.config import deepspeed_keys as keys
from longboat.config import load_config
from longboat.config.errors import ConfigError

# DeepSpeed 0.19.8, deepspeed/runtime/zero/config.py: DeepSpeedZeroConfig's fields, each under
# its name and its alias (the model sets populate_by_name, so both are accepted), at their
# defaults. Offload blocks: deepspeed/runtime/zero/offload_config.py below.
DEEPSPEED_ZERO_DEFAULTS: dict[str, object] = {
    "stage": 3,  # default 0; 3 so the stage-3 keys below are read
    "contiguous_gradients": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 500_000_000,
    "use_multi_rank_bucket_allreduce": True,
    "allgather_partitions": True,
    "allgather_bucket_size": 500_000_000,
    "overlap_comm": None,
    "compute_grad_norm": True,
    "load_from_fp32_weights": True,
    "elastic_checkpoint": False,
    "offload_param": None,
    "offload_optimizer": None,
    "zenflow": None,
    "sub_group_size": 1_000_000_000,
    "cpu_offload_param": None,
    "cpu_offload_use_pin_memory": None,
    "cpu_offload": None,
    "prefetch_bucket_size": 50_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "param_persistence_threshold": 100_000,
    "stage3_param_persistence_threshold": 100_000,
    "model_persistence_threshold": sys.maxsize,
    "stage3_model_persistence_threshold": sys.maxsize,
    "max_live_parameters": 1_000_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "max_reuse_distance": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "gather_16bit_weights_on_model_save": False,
    "stage3_gather_16bit_weights_on_model_save": False,
    "module_granularity_threshold": 0,
    "stage3_module_granularity_threshold": 0,
    "use_all_reduce_for_fetch_params": False,
    "stage3_use_all_reduce_for_fetch_params": False,
    "allgather_sequential": False,
    "stage3_allgather_sequential": False,
    "stage3_gather_fp16_weights_on_model_save": False,
    "ignore_unused_parameters": True,
    "legacy_stage1": False,
    "round_robin_gradients": False,
    "parameter_alignment": False,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "memory_efficient_linear": True,
    "pipeline_loading_checkpoint": False,
    "override_module_apply": True,
    "log_trace_cache_warnings": False,
    "enable_sanity_checks": False,
    "save_muon_momentum_buffer_in_memory": False,
    "leaf_module": {},
}

# deepspeed/runtime/zero/offload_config.py: DeepSpeedZeroOffloadParamConfig and
# DeepSpeedZeroOffloadOptimizerConfig, at their defaults (device cpu, so the block is read).
OFFLOAD_PARAM_DEFAULTS: dict[str, object] = {
    "device": "cpu",
    "nvme_path": None,
    "buffer_count": 5,
    "buffer_size": 100_000_000,
    "max_in_cpu": 1_000_000_000,
    "pin_memory": True,
}
OFFLOAD_OPTIMIZER_DEFAULTS: dict[str, object] = {
    "device": "cpu",
    "nvme_path": None,
    "buffer_count": 4,
    "pin_memory": True,
    "pipeline_read": False,
    "pipeline_write": False,
    "fast_init": False,
    "ratio": 1.0,
    "super_offload": False,
    "cpuadam_cores_perc": 0.8,
}

KNOWN = keys.ZERO_TRANSLATED | set(keys.ZERO_NO_EFFECT) | set(keys.ZERO_REFUSED)


def _load(zero: dict[str, object]) -> object:
    return load_config({"train_batch_size": 8, "zero_optimization": zero})


@pytest.mark.parametrize("key", sorted(DEEPSPEED_ZERO_DEFAULTS))
def test_every_deepspeed_zero_key_has_a_place(key):
    assert key in KNOWN, f"zero_optimization.{key} would be reported as unknown"


@pytest.mark.parametrize("key", sorted(DEEPSPEED_ZERO_DEFAULTS))
def test_every_deepspeed_zero_key_at_its_default_loads(key):
    _load({"stage": 3, key: DEEPSPEED_ZERO_DEFAULTS[key]})


def test_the_whole_zero_block_at_deepspeed_defaults_loads():
    cfg = _load(dict(DEEPSPEED_ZERO_DEFAULTS))
    assert cfg.zero.stage == 3  # type: ignore[attr-defined]


def test_model_persistence_threshold_has_no_effect_and_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="longboat"):
        _load({"stage": 3, "stage3_model_persistence_threshold": 1000})
    assert "zero_optimization.stage3_model_persistence_threshold' has no effect" in caplog.text


@pytest.mark.parametrize(
    ("zero", "words"),
    [
        ({"compute_grad_norm": False}, ["zero_optimization.compute_grad_norm", "true"]),
        ({"zenflow": {"topk_ratio": 0.1}}, ["zero_optimization.zenflow", "offload_optimizer"]),
        ({"zero_quantized_nontrainable_weights": True}, ["quantized_nontrainable_weights"]),
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, ["offload_optimizer.ratio"]),
        ({"offload_param": {"device": "cpu", "max_in_cpu": 10}}, ["offload_param.max_in_cpu"]),
    ],
)
def test_switched_on_they_are_refused_by_name_not_as_typos(zero, words):
    with pytest.raises(ConfigError) as err:
        _load({"stage": 2 if "compute_grad_norm" in zero else 3, **zero})
    msg = str(err.value)
    assert "did you mean" not in msg and "not DeepSpeed keys" not in msg
    for w in words:
        assert w in msg


def test_offload_blocks_at_deepspeed_defaults():
    opt = {k: v for k, v in OFFLOAD_OPTIMIZER_DEFAULTS.items() if v is not None}
    cfg = _load({"stage": 3, "offload_optimizer": opt})
    assert cfg.zero.offload_optimizer.device == "cpu"  # type: ignore[attr-defined]
    # buffer_size and max_in_cpu size DeepSpeed's own parameter buffers: refused by name
    param = {k: v for k, v in OFFLOAD_PARAM_DEFAULTS.items() if v is not None}
    with pytest.raises(ConfigError, match=r"offload_param\.buffer_size.*not supported"):
        _load({"stage": 3, "offload_param": param})
