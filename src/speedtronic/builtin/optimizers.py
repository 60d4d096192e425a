"""Built-in optimizers, registered by name for `optimizer.name`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speedtronic.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from speedtronic.config import OptimizerConfig


def build_adamw(model: Any, config: OptimizerConfig) -> Any:
    from speedtronic.optim.adamw import build_adamw as build

    return build(model, config)


@hookimpl
def register_optimizers(register: Register) -> None:
    register("adamw", build_adamw)
