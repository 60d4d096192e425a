"""One optimizer object for a whole model: Muon for hidden matrices, AdamW for everything else.

Routing is in routing.py. The two inner optimizers (only those with parameters are built) share this
object's ``param_groups`` and ``state``, so to the rest of PyTorch it is one ordinary optimizer: one
``state_dict``/``load_state_dict``, LR schedulers scale every group (each from its own initial LR,
so a separate ``muon_lr`` keeps its ratio to ``lr``), ``zero_grad`` clears everything, and a
closure passed to ``step`` runs exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from speedtronic.optim.routing import Routes, route_parameters


class HybridOptimizer(Optimizer):
    """Routes `model`'s parameters, then steps a Muon and an AdamW over their shares.

    ``make_muon(groups)`` and ``make_adamw(groups)`` build the inner optimizers from ready-made
    param groups (see build_hybrid in builtin/optimizers.py for the defaults Speedtronic uses).
    """

    def __init__(
        self,
        model: nn.Module,
        make_muon: Callable[[list[dict[str, Any]]], Optimizer],
        make_adamw: Callable[[list[dict[str, Any]]], Optimizer],
        adamw_weight_decay: float = 0.0,
        routes: Routes | None = None,
    ) -> None:
        self.routes = routes or route_parameters(model)
        inner: dict[str, Optimizer] = {}
        if self.routes.muon:
            flipped = self.routes.transposed
            muon_groups = [
                {"params": [p for n, p in self.routes.muon if n not in flipped], "route": "muon"},
                {
                    "params": [p for n, p in self.routes.muon if n in flipped],
                    "route": "muon",
                    "transposed": True,
                },
            ]
            inner["muon"] = make_muon([g for g in muon_groups if g["params"]])
        adamw_groups = [
            {"params": [p for _, p in self.routes.adamw if p.ndim >= 2], "weight_decay": adamw_weight_decay},
            {"params": [p for _, p in self.routes.adamw if p.ndim < 2], "weight_decay": 0.0},
        ]
        adamw_groups = [{**g, "route": "adamw"} for g in adamw_groups if g["params"]]
        if adamw_groups:
            inner["adamw"] = make_adamw(adamw_groups)
        if not inner:
            raise ValueError("the model has no trainable parameters")
        self.inner = inner
        all_params = [p for opt in inner.values() for g in opt.param_groups for p in g["params"]]
        super().__init__(all_params, {})
        self._link()

    def _link(self) -> None:
        """Make this object's groups and state the inner optimizers' own (after init and after loading)."""
        groups: list[dict[str, Any]] = []
        for opt in self.inner.values():
            groups.extend(opt.param_groups)
            opt.state = self.state
        self.param_groups = groups

    def _relink_after_load(self) -> None:
        start = 0
        for opt in self.inner.values():
            count = len(opt.param_groups)
            opt.param_groups = self.param_groups[start : start + count]
            opt.state = self.state
            start += count

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.inner.values():
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        routes = [g.get("route") for g in state_dict.get("param_groups", [])]
        ours = [g.get("route") for g in self.param_groups]
        if routes != ours:
            raise ValueError(f"saved optimizer groups {routes} do not match this model's routing {ours}")
        super().load_state_dict(state_dict)
        self._relink_after_load()

    def route_counts(self) -> dict[str, int]:
        return self.routes.counts()

    def __repr__(self) -> str:
        counts = self.routes.counts()
        return f"HybridOptimizer(muon={counts['muon']:,} params, adamw={counts['adamw']:,} params)"
