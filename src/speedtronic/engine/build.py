"""Build the pieces of a run from its config through the plugin registries: model and optimizer."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config
from speedtronic.errors import ConfigError

logger = logging.getLogger("speedtronic.build")


def set_gradient_checkpointing(model: nn.Module, enabled: bool) -> int:
    """Call `set_gradient_checkpointing(enabled)` on every module that has it; returns how many did.

    Architecture-neutral: a plugin model opts in by defining the method.
    """
    count = 0
    for module in model.modules():
        method = getattr(module, "set_gradient_checkpointing", None)
        if callable(method):
            method(enabled)
            count += 1
            if module is model:
                break  # the top-level model handles its children itself
    return count


def build_model(config: Config, vocab_size: int) -> nn.Module:
    """Instantiate `model.name` from the registry with the data's vocabulary size filled in."""
    from speedtronic.plugins import registries

    model_cfg = config.model
    if model_cfg.vocab_size is not None and model_cfg.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model_cfg.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({vocab_size}); raise it or remove it to use the tokenizer's size"
        )
    resolved = model_cfg.model_copy(update={"vocab_size": model_cfg.vocab_size or vocab_size})
    factory = registries().models.get(model_cfg.name)
    try:
        model = factory(resolved)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"model ({model_cfg.name}): {error}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name {model_cfg.name!r}: its factory returned {type(model).__name__}, not a Module"
        )
    if model_cfg.gradient_checkpointing and not set_gradient_checkpointing(model, True):
        raise ConfigError(
            f"gradient_checkpointing: model {model_cfg.name!r} has no set_gradient_checkpointing(enabled) method"
        )
    return model


def build_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    from speedtronic.plugins import registries

    factory = registries().optimizers.get(config.optimizer.name)
    optimizer: Any = factory(model, config.optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer.name {config.optimizer.name!r}: its factory returned {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    if config.optimizer.cautious and not getattr(optimizer, "handles_cautious", False):
        from speedtronic.optim.cautious import Cautious

        logger.info("optimizer %s has no cautious variant: wrapping it", config.optimizer.name)
        optimizer = Cautious(optimizer)
    return optimizer


def optimizer_routes(optimizer: torch.optim.Optimizer) -> dict[str, int] | None:
    """Parameters each route of a hybrid optimizer owns ({"muon": n, "adamw": m}); None otherwise."""
    inner = getattr(optimizer, "inner", None)
    counts = getattr(optimizer, "route_counts", None) or getattr(inner, "route_counts", None)
    return counts() if callable(counts) else None
