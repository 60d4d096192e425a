"""Build the pieces of a run through the registries it is handed: model, optimizer, data, and the data
facts the run plan needs. The engine never reaches for a process-wide plugin host: callers pass
registries (the CLI and `speedtronic.Trainer` pass the installed plugins'; None means the built-ins).

Every builder goes through the same two functions: `build_model_for(config, plan, …)` (the model a
run plan describes, with `model.init_from`'s weights in it — the only place they are loaded) and
`build_data_for(config, plan, …)` (the data the plan read the facts of): the trainer's `build_run`,
the DiLoCo master's reference model and `load_run` alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config, ModelConfig
from speedtronic.engine import streams
from speedtronic.engine.batches import accepts_labels
from speedtronic.engine.data_facts import data_facts
from speedtronic.engine.optimizer import build_optimizer, optimizer_routes
from speedtronic.engine.parallel.distributed import DistContext, World
from speedtronic.engine.parallel.wrap import wrap_model
from speedtronic.engine.sync import Sync
from speedtronic.errors import ConfigError, SpeedtronicError
from speedtronic.plan import RunPlan, model_vocab_size
from speedtronic.registry import Registries, resolve_registries

__all__ = [  # data_facts (read before the plan), the optimizer's builder and the default registries live elsewhere
    "GivenParts",
    "build_data_for",
    "build_model",
    "build_model_for",
    "build_optimizer",
    "data_facts",
    "instantiate_model",
    "model_config_for",
    "optimizer_routes",
    "place_model",
    "resolve_registries",
    "set_gradient_checkpointing",
]


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


def build_model_for(
    config: Config,
    plan: RunPlan,
    registries: Registries | None = None,
    *,
    model: nn.Module | None = None,
    pretrained: bool = True,
) -> nn.Module:
    """The run's model: `model.name` for the plan's derived values (or the user's own `model`), with
    `model.init_from`'s weights copied in when `pretrained` (a fresh run; a resumed one takes its
    checkpoint's weights instead). On the CPU, in the factory's dtype: the caller places it."""
    if model is None:
        model = instantiate_model(plan.model_config(config.model), registries)
    if pretrained and config.model.init_from:
        from speedtronic.engine.pretrained import init_from_pretrained  # continued pretraining

        init_from_pretrained(model, config.model.init_from)
    return model


def build_data_for(
    config: Config, plan: RunPlan, dist: DistContext | None = None, device_type: str = "cpu"
) -> Any:
    """The data bundle (train stream + validation batches) for this rank, with the plan's data seed and
    vocabulary; it must agree with the facts the plan read."""
    from speedtronic.engine.data import build_data

    dist = dist if dist is not None else DistContext()
    data = config.data
    resolved = data.model_copy(
        update={
            "seed": plan.data_seed,
            "vocab_size": plan.data_vocab_size if data.synthetic else data.vocab_size,
        }
    )
    bundle = build_data(resolved, device_type=device_type, rank=dist.rank, world_size=dist.world_size)
    if bundle.vocab_size != plan.data_vocab_size:
        raise SpeedtronicError(  # the plan read the data's facts; the data must agree with them
            f"the data's vocabulary ({bundle.vocab_size}) differs from the plan's "
            f"({plan.data_vocab_size}); the tokenizer or dataset changed while starting"
        )
    return bundle


@dataclass(frozen=True)
class GivenParts:
    """The parts a caller handed `build_run`, used as they are (None: built from the config)."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    train_data: Iterable[Any] | None = None
    val_data: Iterable[Any] | None = None
    hooks: dict[str, Any] | None = None
    sync: Sync | None = None
    progress: bool = True


@dataclass(frozen=True)
class PlacedModel:
    """The run's model on its device: the model itself, what the loop calls (the DDP wrap or the model
    itself), the DDP wrap (or None), the sync the parallel wrap settled on, and whether its forward
    takes labels."""

    raw: nn.Module
    wrapped: nn.Module
    ddp: Any
    sync: Sync | None
    pass_labels: bool


def place_model(
    config: Config,
    plan: RunPlan,
    registries: Registries | None,
    world: World,
    param_dtype: torch.dtype,
    given: GivenParts,
    *,
    pretrained: bool = True,
) -> PlacedModel:
    """`build_model_for` (or the user's `given.model`), moved to the world's device in `param_dtype`, with
    activation streams, then wrapped: fsdp shards it here, before the optimizer is built over its (now
    sharded) parameters; DDP wraps it."""
    raw = build_model_for(config, plan, registries, model=given.model, pretrained=pretrained)
    raw = raw.to(world.device, dtype=param_dtype)
    streams.maybe_enable(raw, config, world.device, plan.gradient_checkpointing)
    pass_labels = accepts_labels(raw)  # read before sharding, which changes the model's class
    wrapped, ddp, sync = wrap_model(raw, plan, world, config, sync=given.sync, optimizer=given.optimizer)
    return PlacedModel(raw, wrapped, ddp, sync, pass_labels)


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
        raise ConfigError(format_validation_error(error, "<mapping>", root=ModelSectionOnly)) from None
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
