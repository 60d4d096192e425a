"""Build the pieces of a run through the registries it is handed: model, optimizer, and the data facts
the run plan needs. The engine never reaches for a process-wide plugin host: callers pass registries
(the CLI and `speedtronic.Trainer` pass the installed plugins'; None means the built-ins alone)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config, ModelConfig, OptimizerConfig
from speedtronic.errors import ConfigError
from speedtronic.plan import DataFacts, data_vocab_size, model_vocab_size, synthetic_vocab_size
from speedtronic.registry import Registries

logger = logging.getLogger("speedtronic.build")


def resolve_registries(registries: Registries | None) -> Registries:
    if registries is not None:
        return registries
    from speedtronic.builtin import builtin_registries

    return builtin_registries()


def data_facts(config: Config) -> DataFacts:
    """The data's vocabulary and tokenizer, read without loading the data (tokenizer file or the
    prepared dataset's meta.json)."""
    from speedtronic.engine.data.tokenizer import load_tokenizer

    data = config.data
    if data.synthetic:
        return DataFacts(synthetic_vocab_size(config), data.tokenizer)
    if data.dataset:
        from speedtronic.engine.data.meta import read_meta

        meta = read_meta(data.dataset)
        spec = data.tokenizer if data.tokenizer is not None else meta["tokenizer"]
        return DataFacts(data_vocab_size(config, int(meta["vocab_size"]), "dataset's"), spec)
    return DataFacts(data_vocab_size(config, load_tokenizer(data.tokenizer).vocab_size), data.tokenizer)


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


def model_config_for(config: Config, data_vocab: int) -> ModelConfig:
    """The model section with derived values filled, as the run plan fills them (for callers that
    have a config and a vocabulary but no plan: shape checks, benchmarks)."""
    return config.model.model_copy(
        update={
            "vocab_size": model_vocab_size(config, data_vocab),
            "max_seq_len": config.model.max_seq_len or config.data.block_size,
            "gradient_checkpointing": config.model.gradient_checkpointing or config.gradient_checkpointing,
        }
    )


def build_model(config: Config, data_vocab: int, registries: Registries | None = None) -> nn.Module:
    """Instantiate `model.name` for data of vocabulary `data_vocab`."""
    return instantiate_model(model_config_for(config, data_vocab), registries)


def instantiate_model(model_cfg: ModelConfig, registries: Registries | None = None) -> nn.Module:
    """Instantiate a resolved model section (every derived value filled) from the registry.

    The factory receives the section as the model's own config class (`register(..., config=Cls)`):
    a section validated by another class (loaded without these registries) is validated again."""
    from pydantic import ValidationError

    from speedtronic.config.loading import format_validation_error
    from speedtronic.config.models import ModelSectionOnly

    found = resolve_registries(registries)
    factory = found.models.get(model_cfg.name)
    try:
        model_cfg = ModelSectionOnly.model_validate({"model": model_cfg}, context={"registries": found}).model
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, "<mapping>")) from None
    try:
        model = factory(model_cfg)
    except ConfigError:
        raise  # already names its field
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


def build_optimizer(
    config: Config | OptimizerConfig, model: nn.Module, registries: Registries | None = None
) -> torch.optim.Optimizer:
    """`optimizer.name` from the registry over `model`'s parameters (wrapped for `cautious`)."""
    options = config.optimizer if isinstance(config, Config) else config
    factory = resolve_registries(registries).optimizers.get(options.name)
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
