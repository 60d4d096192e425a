"""Learning-rate schedules: linear warmup, then cosine / linear decay to min_lr_ratio, or constant.

Implemented as a pure function of the step wrapped in LambdaLR, so the schedule's whole state is the
step counter and resumes exactly. Its length and warm-up come from the run plan (speedtronic.plan).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from speedtronic.plan import RunPlan


def lr_multiplier(
    name: str, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> Callable[[int], float]:
    """step → factor of the peak LR."""
    warmup = warmup_steps or 0
    total = total_steps or 1
    floor = min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if name == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, plan: RunPlan) -> torch.optim.lr_scheduler.LambdaLR:
    """The run plan's schedule over `optimizer`."""
    factor = lr_multiplier(plan.schedule, plan.warmup_steps, plan.schedule_steps, plan.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
