"""Cautious optimizers (arXiv 2411.16085): only move a coordinate where the update agrees with the gradient.

    mask = (u ⊙ g > 0)            u is the direction the optimizer subtracts, g the gradient
    u    ← u · mask / max(mean(mask), 1e-3)

The rescale keeps the update's overall size when part of it is masked; the 1e-3 floor keeps it
finite when nothing (or a zero gradient) agrees. Three forms:

- ``cautious_`` — the mask itself, used by Muon (before orthogonalisation) and by CautiousAdamW;
- ``CautiousAdamW`` — AdamW whose Adam direction is masked; decoupled weight decay is not masked
  (it is a pull towards zero, not a step along the gradient). Same state layout as torch's AdamW.
- ``Cautious(optimizer)`` — a wrapper for any torch optimizer: it takes the step the inner
  optimizer made, Δ = θ_new − θ_old, and keeps it only where it goes downhill (Δ ⊙ g < 0). It cannot
  separate weight decay from the step, so decay is masked along with it; prefer a native variant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

MIN_MASK_MEAN = 1e-3


def cautious_(update: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Mask `update` in place where it disagrees with `grad` and rescale it; returns `update`."""
    mask = (update * grad > 0).to(update.dtype)
    scale = mask.mean().clamp(min=MIN_MASK_MEAN)
    return update.mul_(mask).div_(scale)


class CautiousAdamW(torch.optim.AdamW):
    """AdamW with the cautious mask on the Adam direction (a plain loop; not fused)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = float(group["lr"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CautiousAdamW does not support sparse gradients")
                grad = p.grad
                state = self.state[p]
                if not state:  # the same keys and dtypes torch's AdamW uses, so state dicts interchange
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1**step
                bias2_sqrt = (1 - beta2**step) ** 0.5
                direction = (exp_avg / bias1).div_(exp_avg_sq.sqrt().div_(bias2_sqrt).add_(group["eps"]))
                cautious_(direction, grad)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(direction, alpha=-lr)
        return loss


class Cautious(Optimizer):
    """Wrap any optimizer so each of its steps is masked where it would go uphill.

    Shares the inner optimizer's ``param_groups`` and ``state`` (so LR schedulers and checkpoints
    work unchanged) and keeps one copy of the parameters to measure the step.
    """

    def __init__(self, inner: Optimizer) -> None:
        if isinstance(inner, Cautious):
            raise ValueError("the optimizer is already cautious")
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], dict(inner.defaults))
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.handles_cautious = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        before = [p.detach().clone() for p in params]
        self.inner.step()
        for p, old in zip(params, before, strict=True):
            descent = old - p  # θ_old − θ_new: the direction subtracted, u in the paper
            cautious_(descent, p.grad)
            p.copy_(old.sub_(descent))
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def __repr__(self) -> str:
        return f"Cautious({self.inner!r})"
