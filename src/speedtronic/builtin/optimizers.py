"""Built-in optimizers, registered by name for `optimizer.name`: adamw, muon (hybrid) and muon_plus.

Each factory takes (model, OptimizerConfig) and returns a torch optimizer. These honour
`optimizer.cautious` natively and say so with ``handles_cautious = True``; for any other
optimizer (a plugin's), engine/build.py wraps the result in the generic cautious wrapper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speedtronic.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer

    from speedtronic.config import OptimizerConfig


def build_adamw(model: nn.Module, config: OptimizerConfig) -> Optimizer:
    from speedtronic.optim.adamw import build_adamw as build

    optimizer = build(model, config)
    optimizer.handles_cautious = True  # type: ignore[attr-defined]
    return optimizer


def build_muon(model: nn.Module, config: OptimizerConfig, muon_plus: bool | str | None = None) -> Optimizer:
    """The hybrid: Muon for hidden matrices, AdamW for the rest (see optim/routing.py)."""
    from speedtronic.optim.adamw import make_adamw
    from speedtronic.optim.hybrid import HybridOptimizer
    from speedtronic.optim.muon import Muon, resolve_plus_mode

    plus = resolve_plus_mode(config.muon_plus if muon_plus is None else muon_plus)

    def make_muon(groups: list[dict[str, Any]]) -> Optimizer:
        return Muon(
            groups,
            lr=config.muon_lr or config.lr,
            weight_decay=config.weight_decay,
            momentum=config.muon_momentum,
            nesterov=config.muon_nesterov,
            ns_steps=config.muon_ns_steps,
            ns_schedule=config.muon_ns_schedule,
            eps=config.muon_norm_eps,
            adjust_lr=config.muon_adjust_lr,
            muon_plus=plus,
            cautious=config.cautious,
        )

    optimizer = HybridOptimizer(
        model,
        make_muon,
        lambda groups: make_adamw(groups, config),
        adamw_weight_decay=config.weight_decay,
    )
    optimizer.handles_cautious = True  # type: ignore[attr-defined]
    return optimizer


def build_muon_plus(model: nn.Module, config: OptimizerConfig) -> Optimizer:
    """`muon` with Muon+ on: the configured mode, or `col` when `optimizer.muon_plus` is unset."""
    return build_muon(model, config, muon_plus=config.muon_plus or True)


def muon_state_elements(model: nn.Module) -> int:
    """Optimizer state of the hybrid (the memory plan): one momentum per Muon-routed parameter, two
    AdamW moments per other parameter."""
    from speedtronic.optim.routing import route_parameters

    routes = route_parameters(model)
    return sum(p.numel() for _, p in routes.muon) + 2 * sum(p.numel() for _, p in routes.adamw)


@hookimpl
def register_optimizers(register: Register) -> None:
    register("adamw", build_adamw, state_elements=2)
    register("muon", build_muon, state_elements=muon_state_elements)
    register("muon_plus", build_muon_plus, state_elements=muon_state_elements)
