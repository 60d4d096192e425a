"""The one way back from a checkpoint: (config, plan, model, tokenizer) from a checkpoint path.

`sample` and `export` go through `load_run`, `checkpoint inspect` through `inspect` (the same stored
plan, without building the model) and the trainer's resume through the same `read_checkpoint`, as it
restores every part rather than the model alone. The model is rebuilt from the stored plan — the vocabulary, context and every other derived
value the run trained with — so what a run trained is what comes back, whatever its data was (a
tokenizer of any vocabulary, a prepared dataset, synthetic tokens). A format-1 checkpoint stored no
plan: its plan is derived again from its config, which needs its tokenizer (or prepared dataset).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from speedtronic.config import Config, load_config
from speedtronic.engine.checkpoint.layout import (
    RunCheckpoint,
    checkpoint_summary,
    read_checkpoint,
    read_for_inspection,
)
from speedtronic.errors import CheckpointError, ConfigError, DataError
from speedtronic.plan import DeviceFacts, RunPlan, plan_run
from speedtronic.registry import Registries


@dataclass
class LoadedRun:
    checkpoint: RunCheckpoint
    config: Config
    plan: RunPlan
    model: nn.Module | None  # None when load_run(build_model=False)
    tokenizer: Any

    @property
    def path(self) -> Path | None:
        return self.checkpoint.path


def stored_config(checkpoint: RunCheckpoint) -> Config:
    try:
        return load_config(checkpoint.config)
    except ConfigError as error:
        raise CheckpointError(f"{checkpoint.path}: its stored config no longer validates ({error})") from None


def stored_plan(checkpoint: RunCheckpoint, config: Config) -> RunPlan:
    """The plan the checkpoint's run trained with (derived again from its config for a checkpoint
    that stores none: format 1, or one written by hand)."""
    if checkpoint.plan is not None:
        try:
            return RunPlan.from_dict(checkpoint.plan)
        except ConfigError as error:
            raise CheckpointError(f"{checkpoint.path}: {error}") from None
    from speedtronic.engine.data_facts import data_facts

    try:
        facts = data_facts(config)
    except (DataError, ConfigError, OSError) as error:
        raise CheckpointError(
            f"{checkpoint.path} stores no run plan (format {checkpoint.format}), and its data's vocabulary "
            f"cannot be read again ({error}); make its tokenizer or dataset available"
        ) from None
    return plan_run(config, data=facts, device=DeviceFacts("cpu"), start_step=checkpoint.step)


def load_run(
    path: str | Path,
    *,
    device: str = "cpu",
    registries: Registries | None = None,
    build_model: bool = True,
) -> LoadedRun:
    """Read the checkpoint at `path` (a step_*.pt file or a checkpoint directory: its latest) and
    rebuild its run: the user config, the plan, the tokenizer and (unless build_model=False) the
    model with its trained weights, in eval mode on `device`."""
    from speedtronic.engine.data import load_tokenizer

    checkpoint = read_checkpoint(path)
    config = stored_config(checkpoint)
    plan = stored_plan(checkpoint, config)
    try:
        tokenizer = load_tokenizer(plan.tokenizer)
    except DataError as error:
        raise CheckpointError(
            f"{checkpoint.path}: the run's tokenizer cannot be loaded ({error}); put it back at the path "
            "the run used"
        ) from None
    model = None
    if build_model:
        model = rebuild_model(checkpoint, config, plan, registries)
        from speedtronic.engine.device import resolve_device

        model = model.to(resolve_device(device)).eval()
    return LoadedRun(checkpoint, config, plan, model, tokenizer)


def rebuild_model(
    checkpoint: RunCheckpoint, config: Config, plan: RunPlan, registries: Registries | None
) -> nn.Module:
    """The model the plan describes, built as the run built it (engine/build.py), with the
    checkpoint's weights loaded (strictly) in place of any `model.init_from`."""
    from speedtronic.engine.build import build_model_for

    model = build_model_for(config, plan, registries, pretrained=False)
    load_weights(model, checkpoint.part("model"), checkpoint.path)
    return model


# What a run that resumes a checkpoint of another model is told: the checkpoint belongs to an earlier
# run under the same run.name (an edited copy of a config keeps it), and `--no-resume` is refused
# while checkpoints exist (it would overwrite them), so a new run name is the fix.
RESUME_MISMATCH_FIX = (
    "this run resumes it because its checkpoint.directory holds an earlier run of the same run.name: "
    "to train this config as a new run set another run.name (--set run.name=NEW), or restore the config "
    "that run was trained with to continue it"
)


def load_weights(model: nn.Module, state: Any, source: Path | str | None, fix: str | None = None) -> None:
    """`model.load_state_dict(state)` with a one-line error naming the first mismatch (and `fix`, else
    the generic one)."""
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = lines[1] if len(lines) > 1 else (lines[0] if lines else type(error).__name__)
        fix = fix or "use the config it was trained with, or another checkpoint"
        raise CheckpointError(
            f"{source}: the weights do not fit the model its plan describes ({first}); {fix}"
        ) from None


def inspect(path: str | Path) -> dict[str, Any]:
    """What `speedtronic checkpoint inspect` shows: the summary, with the plan's real vocabulary
    (derived again for a format-1 checkpoint when its tokenizer or dataset is at hand)."""
    checkpoint = read_for_inspection(path)
    plan = checkpoint.plan
    if plan is None:
        try:
            plan = stored_plan(checkpoint, stored_config(checkpoint)).as_dict()
        except CheckpointError:
            plan = None  # the rest of the summary is still worth showing
    return checkpoint_summary(checkpoint, plan)
