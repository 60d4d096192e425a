"""AdamW with the usual LLM parameter groups, using the fused kernel where the device supports it.

Matrices (embeddings, linear weights) get weight decay; vectors (norm gains, biases) do not — decaying
a norm gain towards zero only fights the normalisation. Tied weights are one parameter and appear once.
With `optimizer.cautious` the cautious variant (optim/cautious.py) is used; it has no fused kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.errors import ConfigError
from speedtronic.optim.cautious import CautiousAdamW


def fused_supported(params: list[torch.nn.Parameter]) -> bool:
    """The fused AdamW kernel needs every parameter on a CUDA (or MPS/XPU) device in a float dtype."""
    return bool(params) and all(
        p.device.type in ("cuda", "xpu", "mps") and p.is_floating_point() for p in params
    )


def make_adamw(groups: list[dict[str, Any]], config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW (or cautious AdamW) over ready-made param groups, with the config's hyperparameters."""
    if config.cautious:
        if config.fused:
            raise ConfigError(
                "optimizer.fused: cautious AdamW has no fused kernel; set fused to false or cautious to false"
            )
        return CautiousAdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)
    params = [p for g in groups for p in g["params"]]
    fused = fused_supported(params) if config.fused is None else config.fused
    if fused and not fused_supported(params):
        raise ConfigError(
            "optimizer.fused: the fused AdamW kernel needs parameters on a GPU; set it to false"
        )
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=fused or None)


def build_adamw(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() yields tied weights once
    if not params:
        raise ValueError("the model has no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": g, "weight_decay": wd} for g, wd in ((decay, config.weight_decay), (no_decay, 0.0)) if g
    ]
    return make_adamw(groups, config)
