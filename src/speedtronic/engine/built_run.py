"""The `Run`: every part of one training run, built and frozen (engine/run.py's `build_run` builds it;
the Trainer loops over it; engine/checkpoint/parts.py captures and restores its parts)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.config import Config
from speedtronic.engine.checkpoint.layout import RunCheckpoint
from speedtronic.engine.checkpoint.stateful import Stateful, TrainCounters
from speedtronic.engine.events import EventBus
from speedtronic.engine.parallel.distributed import DistContext
from speedtronic.engine.precision import PrecisionPlan
from speedtronic.engine.sync import Sync
from speedtronic.plan import RunPlan
from speedtronic.registry import Registries


@dataclass(frozen=True)
class Run:
    """Every part of one training run, built; the Trainer is the loop over it."""

    config: Config
    registries: Registries
    plan: RunPlan
    precision: PrecisionPlan
    dist: DistContext
    device: torch.device
    raw_model: nn.Module  # the model itself (its parameters sharded in place under fsdp)
    model: nn.Module  # what the loop calls: the DDP wrap, or the model itself
    ddp: Any  # the DistributedDataParallel wrap, or None
    fsdp: bool
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    counters: TrainCounters
    data: Stateful  # the training batches, resumable
    val_source: Iterable[Any] | None  # the user's validation batches (else the data bundle's)
    data_bundle: Any  # the built data (None for user-supplied training data)
    events: EventBus
    sync: Sync | None
    parts: dict[str, Stateful]  # what a checkpoint holds: {name: part.state_dict()}
    pass_labels: bool
    user_optimizer: bool
    progress: bool  # show a progress display (rank 0)
    resume: RunCheckpoint | None = None  # the checkpoint the parts were restored from
    resume_changes: list[str] = field(default_factory=list)  # optimizer settings the config changed

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.config.checkpoint_dir())

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.raw_model.parameters() if p.requires_grad]
