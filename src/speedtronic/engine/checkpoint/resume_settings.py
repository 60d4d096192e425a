"""On resume, the optimizer's hyperparameters come from this run's config, not from the checkpoint.

`optimizer.load_state_dict` restores every param group as it was saved — learning rate, weight decay,
betas — and the LR scheduler restores its base rates. A user who resumes with
`--set optimizer.lr=1e-3` sees 1e-3 in the printed config and plan, so training must use it too: the
optimizer's moments, the step count and the schedule's position carry over from the checkpoint, the
hyperparameters the freshly built optimizer was given win, and each change is logged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger("speedtronic.train")

# Group keys that are bookkeeping, not settings a user chose (the scheduler owns lr/initial_lr).
_NOT_SETTINGS = {"params", "lr", "initial_lr", "param_names"}


def settings(optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[list[dict[str, Any]], list[float]]:
    """The hyperparameters of a freshly built optimizer's groups and its scheduler's base rates."""
    groups = [{k: v for k, v in g.items() if k not in _NOT_SETTINGS} for g in optimizer.param_groups]
    base = [float(b) for b in getattr(scheduler, "base_lrs", [])]
    return groups, base


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.as_tensor(a).tolist() == torch.as_tensor(b).tolist()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return list(a) == list(b)
    return bool(a == b)


def reapply(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    fresh: tuple[list[dict[str, Any]], list[float]],
) -> list[str]:
    """Put the fresh hyperparameters back after a checkpoint's state was loaded; returns what changed
    ("group 0 lr 0.003 → 0.001"), also logged. The schedule keeps its position: the learning rate of
    the step about to be taken is the fresh base rate times the schedule's factor at that position."""
    groups, base = fresh
    changes: list[str] = []
    if len(groups) != len(optimizer.param_groups):
        return changes  # another grouping: load_state_dict has already refused it
    lambdas = getattr(scheduler, "lr_lambdas", None)
    for i, (group, wanted) in enumerate(zip(optimizer.param_groups, groups, strict=True)):
        for key, value in wanted.items():
            if key in group and not _same(group[key], value):
                changes.append(f"group {i} {key} {group[key]} → {value}")
                group[key] = value
        if i < len(base) and scheduler is not None and not _same(scheduler.base_lrs[i], base[i]):
            changes.append(f"group {i} lr {scheduler.base_lrs[i]:g} → {base[i]:g}")
            scheduler.base_lrs[i] = base[i]
            group["initial_lr"] = base[i]
            factor = lambdas[i](scheduler.last_epoch) if lambdas else 1.0
            group["lr"] = base[i] * factor
    if changes:
        logger.warning(
            "resumed with the config's optimizer settings, not the checkpoint's: %s", "; ".join(changes)
        )
    return changes
