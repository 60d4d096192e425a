"""The run's optimizer: `optimizer.name` from the registry (wrapped for `cautious`), and what the
routes of a hybrid optimizer own (for the summary and the result)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from speedtronic.config import Config, OptimizerConfig
from speedtronic.config.optimizers import resolve_optimizer_section
from speedtronic.errors import ConfigError
from speedtronic.registry import Registries, resolve_registries

logger = logging.getLogger("speedtronic.build")


def build_optimizer(
    config: Config | OptimizerConfig, model: nn.Module, registries: Registries | None = None
) -> torch.optim.Optimizer:
    """`optimizer.name` from the registry over `model`'s parameters (wrapped for `cautious`)."""
    section = config.optimizer if isinstance(config, Config) else config
    found = resolve_registries(registries)
    factory = found.optimizers.get(section.name)
    options = _typed_section(section, found)
    optimizer: Any = factory(model, options)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer.name {options.name!r}: its factory returned {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    if options.cautious and not getattr(optimizer, "handles_cautious", False):
        from speedtronic.optim.cautious import Cautious

        logger.info("optimizer %s has no cautious variant: wrapping it", options.name)
        optimizer = Cautious(optimizer)
    return optimizer


def optimizer_routes(optimizer: torch.optim.Optimizer) -> dict[str, int] | None:
    """Parameters each route of a hybrid optimizer owns ({"muon": n, "adamw": m}); None otherwise."""
    inner = getattr(optimizer, "inner", None)
    counts = getattr(optimizer, "route_counts", None) or getattr(inner, "route_counts", None)
    return counts() if callable(counts) else None


def _typed_section(options: OptimizerConfig, registries: Registries) -> OptimizerConfig:
    """The section as the optimizer's own config class (`register(..., config=Cls)`): a section
    validated by another class (loaded without these registries) is validated again."""
    try:
        return resolve_optimizer_section(options, registries)
    except ValidationError as error:
        raise ConfigError(f"optimizer ({options.name}): {error}") from None
