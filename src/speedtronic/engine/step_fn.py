"""Small per-step helpers of the training step that keep its host-side bookkeeping cheap.

`ensure_train_mode(model)` is `model.train()` at the cost of a flag check. `nn.Module.train()` walks
every submodule through `__setattr__` — 0.2 ms a step for the 4-layer reference model, two thirds of
the trainer's whole per-step overhead over a hand-written loop (bench/overhead.py on a 1-layer model)
— while between evaluations nothing turns a flag off. It still ends with every module training, as
`model.train()` does, whoever turned one off.
"""

from __future__ import annotations

import weakref

from torch import nn

# Each model's modules, listed once: a model's module tree does not change during training.
_MODULES: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()


def ensure_train_mode(model: nn.Module) -> None:
    """Put `model` and every submodule in training mode, unless they all are already."""
    modules = _MODULES.get(model)
    if modules is None:
        modules = _MODULES[model] = list(model.modules())
    if not all(module.training for module in modules):
        model.train()
