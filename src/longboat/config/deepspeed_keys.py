"""What each DeepSpeed config key that longboat does not translate becomes: accepted with no
effect here (and one log line that says why), accepted only while switched off, or refused;
and the near-miss of a real key, for a misspelt one.

[Note: DeepSpeed keys] A key is in one of four places. Translated (``deepspeed.py``): it has a
meaning here and keeps DeepSpeed's. No effect: it tunes something longboat does differently or
not at all (CUDA kernels, allocator behaviour, DeepSpeed's own buffers and prints), so training is
the same with or without it; accepted, and logged once. Off only: a feature longboat does not
have, accepted while it is switched off (a config that says ``"enabled": false`` trains the same
here) and refused with the reason when on. Anything else is refused by name, with the real key
it is closest to when there is one.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

NO_EFFECT: dict[str, str] = {
    "steps_per_print": "",  # translated (monitor.every); listed for the suggestions only
    "dump_state": "it prints DeepSpeed's engine state; `longboat config explain` shows the config",
    "memory_breakdown": "it prints allocator statistics; see engine.memory_report()",
    "zero_allow_untested_optimizer": (
        "longboat checks the optimizer itself (ZeRO takes element-wise optimizers)"
    ),
    "zero_force_ds_cpu_optimizer": "the optimizer you give steps, wherever the state lives",
    "prescale_gradients": (
        "gradients are averaged over the ranks either way; where the division happens changes "
        "only rounding"
    ),
    "gradient_predivide_factor": (
        "gradients are averaged over the ranks either way; where the division happens changes "
        "only rounding"
    ),
    "checkpoint": (
        "it tunes DeepSpeed's checkpoint files; longboat's are verified, written atomically and "
        "load at any world size"
    ),
    "aio": "it tunes libaio; longboat's offload reads and writes with pread/pwrite",
    "timers": "DeepSpeed's throughput timers; longboat's monitor reports samples/s",
}

# key -> why it is refused when switched on
OFF_ONLY: dict[str, str] = {
    "comet": "Comet is not a monitor sink here; use tensorboard or csv_monitor",
    "elasticity": (
        "DeepSpeed's elastic batch sizes are not offered; `longboat run --max-restarts N` "
        "restarts a job and checkpoints load at any world size"
    ),
    "autotuning": "DeepSpeed's autotuner is not offered; `longboat plan` predicts memory",
    "amp": "NVIDIA Apex AMP is not offered; use fp16 or bf16",
    "sparse_gradients": "sparse gradients are not offered",
    "compression_training": "DeepSpeed's compression training is not offered",
    "data_efficiency": "DeepSpeed's data efficiency library is not offered",
    "curriculum_learning": "curriculum learning is not offered",
    "hybrid_engine": "DeepSpeed's RLHF hybrid engine is not offered",
    "nebula": "Nebula checkpointing is not offered; longboat's checkpoints are its own",
    "weight_quantization": "weight quantization is not offered",
    "quantize_training": "quantized training is not offered",
    "progressive_layer_drop": "progressive layer drop is not offered",
    "eigenvalue": "eigenvalue computation is not offered",
    "torch_autocast": "use bf16 or fp16 (longboat runs the forward under torch.autocast)",
    "sparse_attention": "DeepSpeed's sparse attention kernels are not offered",
}

ZERO_NO_EFFECT: dict[str, str] = {
    "cpu_offload": "",  # DeepSpeed's old names, read as offload_* (deepspeed.py)
    "cpu_offload_param": "",
    "cpu_offload_params": "",
    "cpu_offload_use_pin_memory": "pinned memory matters with an accelerator only",
    "allgather_partitions": "longboat all-gathers each unit's shards",
    "allgather_bucket_size": "longboat all-gathers unit by unit",
    "overlap_comm": "longboat always overlaps reductions with the backward",
    "reduce_scatter": "the average is the same whether reduce-scattered or all-reduced",
    "contiguous_gradients": "gradients are reduced from each unit's contiguous buffer",
    "round_robin_gradients": "it balances DeepSpeed's CPU-offload copies",
    "sub_group_size": "the optimizer steps unit by unit",
    "stage3_max_live_parameters": "stage 3 holds the running unit and the prefetched one",
    "stage3_max_reuse_distance": "stage 3 frees a unit after its forward and its backward",
    "stage3_param_persistence_threshold": (
        "small parameters go with their module's unit; set zero.unit_classes or "
        "zero.unit_min_params to choose units"
    ),
    "stage3_model_persistence_threshold": (
        "small parameters go with their module's unit; set zero.unit_classes or "
        "zero.unit_min_params to choose units"
    ),
    "stage3_module_granularity_threshold": (
        "units are chosen by zero.unit_classes or zero.unit_min_params"
    ),
    "leaf_module": "units are chosen by zero.unit_classes or zero.unit_min_params",
    "stage3_allgather_sequential": "longboat all-gathers unit by unit",
    "stage3_gather_16bit_weights_on_model_save": (
        "checkpoints hold the full-precision state and load at any layout"
    ),
    "gather_16bit_weights_on_model_save": (
        "checkpoints hold the full-precision state and load at any layout"
    ),
    "stage3_gather_fp16_weights_on_model_save": (
        "checkpoints hold the full-precision state and load at any layout"
    ),
    "ignore_unused_parameters": "unused parameters are always handled (they get no gradient)",
    "elastic_checkpoint": "checkpoints load at any world size",
    "load_from_fp32_weights": "checkpoints hold fp32 weights",
    "memory_efficient_linear": "it selects a DeepSpeed linear kernel",
    "use_multi_rank_bucket_allreduce": "it tunes DeepSpeed's bucketed all-reduce",
    "log_trace_cache_warnings": "it tunes DeepSpeed's stage-3 trace cache",
    "use_all_reduce_for_fetch_params": "it tunes how DeepSpeed gathers parameters",
    "stage3_use_all_reduce_for_fetch_params": "it tunes how DeepSpeed gathers parameters",
    "legacy_stage1": "it selects DeepSpeed's old stage-1 code; the sharding is the same",
    "parameter_alignment": "it pads DeepSpeed's flat buffers",
    "pipeline_loading_checkpoint": "it tunes how DeepSpeed loads a pipelined checkpoint",
    "override_module_apply": "it wraps module.apply for DeepSpeed's stage-3 hooks",
    "enable_sanity_checks": "it enables DeepSpeed's internal stage-3 checks",
    "save_muon_momentum_buffer_in_memory": "it keeps Muon's buffer out of DeepSpeed's NVMe swap",
}
# DeepSpeedZeroConfig's fields that have a stage3_ alias take either name (populate_by_name):
# the short name means what the stage3_ one does.
ZERO_ALIASES: dict[str, str] = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "allgather_sequential": "stage3_allgather_sequential",
}
for _short, _long in ZERO_ALIASES.items():
    if _long in ZERO_NO_EFFECT:
        ZERO_NO_EFFECT[_short] = ZERO_NO_EFFECT[_long]

# zero_optimization keys refused by name (why, and what to use)
ZERO_REFUSED: dict[str, str] = {
    "zero_hpz_partition_size": (
        "ZeRO++'s secondary partition is not offered; hybrid sharding is mesh.dp_shard"
    ),
    "zero_quantized_weights": "ZeRO++'s quantized weights are not offered",
    "zero_quantized_nontrainable_weights": "ZeRO++'s quantized weights are not offered",
    "zero_quantized_gradients": "ZeRO++'s quantized gradients are not offered",
    "zenflow": "ZenFlow's stale CPU-offload updates are not offered; use zero.offload_optimizer",
    "compute_grad_norm": (
        "longboat always computes the gradient norm (clipping and the monitor read it); "
        "set it to true or remove it"
    ),
    "mics_shard_size": "MiCS is not offered; hybrid sharding is mesh.dp_shard",
    "mics_hierarchical_params_gather": "MiCS is not offered",
}

# Every zero_optimization key longboat translates (deepspeed.py), for the suggestions.
ZERO_TRANSLATED = frozenset(
    {
        "stage",
        "reduce_bucket_size",
        "offload_optimizer",
        "offload_param",
        "stage3_prefetch_bucket_size",
        "prefetch_bucket_size",
    }
)


def disabled(value: Any) -> bool:
    """Whether a block is switched off: ``false``, ``{}`` or ``{"enabled": false, ...}``."""
    if value is False or value is None:
        return True
    if isinstance(value, Mapping):
        return not value or value.get("enabled") is False
    return False


def near_miss(key: str, known: Iterable[str]) -> str:
    """`` (did you mean 'X'?)`` for a key close to a real one, else empty."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
    return f" (did you mean '{close[0]}'?)" if close else ""


__all__ = [
    "NO_EFFECT",
    "OFF_ONLY",
    "ZERO_ALIASES",
    "ZERO_NO_EFFECT",
    "ZERO_REFUSED",
    "ZERO_TRANSLATED",
    "disabled",
    "near_miss",
]
