"""Run configuration: pydantic sections, YAML loading with `--set` overrides, and secret redaction.

Importing this package never imports torch.
"""

from speedtronic.config.loading import ALIASES, config_to_yaml, dump_config, load_config, read_yaml
from speedtronic.config.schema import (
    CheckpointConfig,
    CompileConfig,
    Config,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    PrecisionConfig,
    RunConfig,
    SchedulerConfig,
    ShapeValidationConfig,
)
from speedtronic.secrets import REDACTED, scrub

__all__ = [
    "ALIASES",
    "REDACTED",
    "CheckpointConfig",
    "CompileConfig",
    "Config",
    "DataConfig",
    "DistributedConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "RunConfig",
    "SchedulerConfig",
    "ShapeValidationConfig",
    "config_to_yaml",
    "dump_config",
    "load_config",
    "read_yaml",
    "scrub",
]
