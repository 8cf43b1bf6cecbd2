"""Typed, validated configuration.

One frozen model per component (:mod:`~longboat.config.sections`), loaded from a dict, a
TOML/JSON/YAML file or the DeepSpeed JSON dialect (:mod:`~longboat.config.deepspeed`); the batch
triple resolved with an explanation (:mod:`~longboat.config.batch`). Every error is a
:class:`ConfigError` that names the key, the value and how to fix it. This package imports
nothing else of longboat.
"""

from longboat.config.batch import ResolvedBatch, resolve_batch
from longboat.config.errors import ConfigError
from longboat.config.loading import LoadedConfig, explain, flatten, load, load_config, read_mapping
from longboat.config.sections import (
    ActivationCheckpointingConfig,
    BatchConfig,
    CheckpointConfig,
    CommConfig,
    CompileConfig,
    CompressionConfig,
    Config,
    DataConfig,
    LogConfig,
    MeshConfig,
    MonitorConfig,
    OptimizerConfig,
    ParameterServerConfig,
    PipelineConfig,
    PrecisionConfig,
    ProfileConfig,
    RecoveryConfig,
    ReplicateConfig,
    SchedulerConfig,
    SinkConfig,
    StrategyName,
    TensorParallelConfig,
    ZeroConfig,
)

__all__ = [
    "ActivationCheckpointingConfig",
    "BatchConfig",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "CompressionConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoadedConfig",
    "LogConfig",
    "MeshConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParameterServerConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "RecoveryConfig",
    "ReplicateConfig",
    "ResolvedBatch",
    "SchedulerConfig",
    "SinkConfig",
    "StrategyName",
    "TensorParallelConfig",
    "ZeroConfig",
    "explain",
    "flatten",
    "load",
    "load_config",
    "read_mapping",
    "resolve_batch",
]
