"""Run configuration: pydantic sections, YAML loading with `--set` overrides, and secret redaction.

Importing this package never imports torch. Its names load on first use (PEP 562), so a model config
module (`speedtronic.config.models`, which plugins subclass) can be imported without the whole
schema — the built-in model's config is imported *by* the schema, for its default model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from speedtronic.config.loading import ALIASES, read_yaml
    from speedtronic.config.models import BaseModelConfig, ModelConfig
    from speedtronic.config.schema import (
        CheckpointConfig,
        CompileConfig,
        Config,
        DataConfig,
        DistributedConfig,
        LoggingConfig,
        OptimizerConfig,
        PrecisionConfig,
        RunConfig,
        SchedulerConfig,
        ShapeValidationConfig,
        config_to_yaml,
        dump_config,
        load_config,
    )
    from speedtronic.secrets import REDACTED, scrub

_LAZY = {
    **dict.fromkeys(("ALIASES", "read_yaml"), "loading"),
    **dict.fromkeys(("BaseModelConfig", "ModelConfig"), "models"),
    **dict.fromkeys(
        (
            "CheckpointConfig",
            "CompileConfig",
            "Config",
            "DataConfig",
            "DistributedConfig",
            "LoggingConfig",
            "OptimizerConfig",
            "PrecisionConfig",
            "RunConfig",
            "SchedulerConfig",
            "ShapeValidationConfig",
            "config_to_yaml",
            "dump_config",
            "load_config",
        ),
        "schema",
    ),
}

__all__ = [
    "ALIASES",
    "REDACTED",
    "BaseModelConfig",
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


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562)."""
    if name in ("REDACTED", "scrub"):
        return getattr(importlib.import_module("speedtronic.secrets"), name)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'speedtronic.config' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"speedtronic.config.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value
