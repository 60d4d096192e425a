"""Small per-step helpers of the training step that keep its host-side bookkeeping cheap.

`ensure_train_mode(model)` is `model.train()` at the cost of a flag check. `nn.Module.train()` walks
every submodule through `__setattr__` — 0.2 ms a step for the 4-layer reference model, two thirds of
the trainer's whole per-step overhead over a hand-written loop (bench/overhead.py on a 1-layer model)
— while between evaluations nothing turns a flag off. It still ends with every module training, as
`model.train()` does, whoever turned one off.

`FiniteWatch` remembers the first step whose loss was not finite without a host sync and without a
kernel per step: it keeps each step's loss tensor and checks them on the device together, every
`FiniteWatch.FOLD` steps and when asked (five tiny kernels a step were a quarter of the eager trainer's
overhead on a small model).
"""

from __future__ import annotations

import weakref

import torch
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


class FiniteWatch:
    """The first step (in this process) whose loss was not finite, 0 if none, kept on the device."""

    FOLD = 64  # steps whose losses are held before they are checked together

    def __init__(self, device: torch.device) -> None:
        self._first = torch.zeros((), dtype=torch.long, device=device)
        self._start = 0  # the step of self._losses[0]; the held losses are of consecutive steps
        self._losses: list[torch.Tensor] = []

    def note(self, step: int, loss: torch.Tensor) -> None:
        """Hold step `step`'s loss (a 0-d tensor) for the next check; no kernel runs here."""
        if self._losses and step != self._start + len(self._losses):
            self._fold()
        if not self._losses:
            self._start = step
        self._losses.append(loss)
        if len(self._losses) >= self.FOLD:
            self._fold()

    def first_bad(self) -> torch.Tensor:
        """The first step with a non-finite loss, 0 if none (a 0-d tensor on the device: no sync)."""
        self._fold()
        return self._first

    def _fold(self) -> None:
        if not self._losses:
            return
        bad = ~torch.isfinite(torch.stack(self._losses).float())
        first_here = bad.int().argmax() + self._start  # argmax: the first maximum, the first bad one
        self._first = torch.where((self._first == 0) & bad.any(), first_here, self._first)
        self._losses.clear()
