"""Learning-rate schedules: linear warmup, then cosine / linear decay to min_lr_ratio, or constant.

Implemented as a pure function of the step wrapped in LambdaLR, so the schedule's whole state is the
step counter and resumes exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from speedtronic.config import SchedulerConfig


def lr_multiplier(config: SchedulerConfig) -> Callable[[int], float]:
    """step → factor of the peak LR."""
    warmup = config.warmup_steps or 0
    total = config.max_steps or 1
    floor = config.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if config.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if config.name == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config))
