"""A run's parts and its checkpoints: restoring the parts from the checkpoint a run resumes (which one,
`find_resume` in engine/checkpoint/layout.py says), and capturing and writing them.

A checkpoint is `{name: part.state_dict()}` over the run's stateful parts (engine/checkpoint/layout.py
holds the format, engine/checkpoint/files.py the files), so resume is exact — a resumed run is bitwise
identical to an uninterrupted one on CPU in fp32 — also with a user's own optimizer and scheduler.
Under fsdp the model and optimizer are written as shards by every rank (engine/checkpoint/sharded.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speedtronic.config import dump_config
from speedtronic.engine.checkpoint import resume_settings, sharded
from speedtronic.engine.checkpoint.layout import (
    RunCheckpoint,
    tied_names,
    write_checkpoint,
    write_sharded_checkpoint,
)
from speedtronic.engine.checkpoint.load_run import RESUME_MISMATCH_FIX, load_weights
from speedtronic.errors import CheckpointError
from speedtronic.plan import RunPlan

if TYPE_CHECKING:
    from speedtronic.engine.built_run import Run

logger = logging.getLogger("speedtronic.train")

_REQUIRED = ("model", "optimizer", "scheduler", "rng", "counters")


def restore(run: Run, checkpoint: RunCheckpoint) -> list[str]:
    """Restore every part of `run` from `checkpoint` (the model strictly; a part the run does not
    have, such as a grad scaler under another precision, is skipped). Returns the optimizer settings
    the config changed against the checkpoint's (they are kept as the config says)."""
    source = checkpoint.path or "checkpoint"
    fresh = resume_settings.settings(run.optimizer, run.scheduler)  # the config's, before loading
    done: tuple[str, ...] = ()
    if checkpoint.sharded is not None:
        sharded.load_sharded(run.raw_model, run.optimizer, checkpoint, run.dist.enabled)
        done = ("model", "optimizer")
    elif run.fsdp:
        sharded.load_whole_into_shards(run.raw_model, run.optimizer, checkpoint)
        done = ("model", "optimizer")
    for name, part in run.parts.items():
        if name in done:
            continue
        state = checkpoint.part(name)
        if name == "rng" and isinstance(state, dict) and state.get("ranks"):
            ranks = state["ranks"]  # this rank's own streams where the saving run had this rank
            state = ranks[run.dist.rank] if run.dist.rank < len(ranks) else ranks[0]
        if state is None:
            if name in _REQUIRED:
                raise CheckpointError(f"{source} has no {name} state; resume from another step_*.pt")
            continue
        if name == "model":
            load_weights(part, state, source, RESUME_MISMATCH_FIX)
            continue
        try:
            part.load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as error:
            raise CheckpointError(
                f"{source}: the {name} state does not fit this run ({type(error).__name__}: {error}); "
                f"{RESUME_MISMATCH_FIX}"
            ) from None
    changes = resume_settings.reapply(run.optimizer, run.scheduler, fresh)
    tokens = run.counters.tokens_seen
    logger.info("resumed from %s at step %d (%s tokens seen)", source, run.counters.step, f"{tokens:,}")
    return changes


def capture(run: Run, plan: RunPlan, metrics: dict[str, Any]) -> RunCheckpoint:
    """The run's state now: the user config, the plan and every part's state_dict(). Under fsdp the
    model and optimizer are not in it (`write` writes them as shards), and the RNG part carries every
    rank's streams."""
    sharded = ("model", "optimizer") if plan.strategy == "fsdp" else ()
    parts = {name: part.state_dict() for name, part in run.parts.items() if name not in sharded}
    if sharded and run.dist.enabled:
        ranks: list[Any] = [None] * run.dist.world_size
        torch.distributed.all_gather_object(ranks, parts["rng"])
        parts["rng"] = {**parts["rng"], "ranks": ranks}
    return RunCheckpoint(
        step=run.counters.step,
        config=dump_config(run.config),
        plan=plan.as_dict(),
        parts=parts,
        metrics=metrics,
    )


def writes(run: Run, plan: RunPlan) -> bool:
    """Whether this rank writes checkpoints: every rank under fsdp (its shards), else rank 0."""
    return plan.strategy == "fsdp" or run.dist.is_main


def write(run: Run, plan: RunPlan, checkpoint: RunCheckpoint) -> Path | None:
    """Write `checkpoint`: under fsdp every rank its shards (also alone: the same layout), else the
    whole file; the path written, or None where a sharded write left nothing to point at."""
    directory, keep_last = Path(run.config.checkpoint_dir()), run.config.checkpoint.keep_last
    if plan.strategy == "fsdp":
        return write_sharded_checkpoint(
            directory,
            checkpoint,
            sharded.shards(run.raw_model, run.optimizer),
            keep_last,
            aliases=tied_names(run.raw_model),
        )
    return write_checkpoint(directory, checkpoint, keep_last)
