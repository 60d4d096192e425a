"""The model's and optimizer's state as torch.distributed.checkpoint (DCP) holds it, for fsdp runs.

Under `distributed.strategy: fsdp` each rank holds shards of the parameters and of the optimizer
state. A checkpoint stores them with DCP (every rank writes its own shard files, see
engine/checkpoint/layout.py), keyed by parameter name, and loading reshards them onto whatever number of
ranks the resuming run has. A whole (single-file) checkpoint can also be read into a sharded run.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speedtronic.engine.checkpoint.layout import RunCheckpoint
from speedtronic.errors import CheckpointError


def shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state keyed by parameter name, as this rank holds it (DCP's
    layout: sharded DTensors under fsdp, whole tensors otherwise)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: RunCheckpoint, distributed: bool
) -> None:
    """Model and optimizer from a sharded checkpoint, read into this run's own layout: DCP reshards
    whatever number of ranks wrote it onto this run's ranks (or one process)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    assert checkpoint.sharded is not None
    state = shards(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=checkpoint.sharded, no_dist=not distributed)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except Exception as error:  # DCP wraps every rank's failure in its own exception type
        raise CheckpointError(
            f"{checkpoint.sharded}: the model or optimizer state does not fit this run "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); use the config "
            "it was trained with"
        ) from None


def load_whole_into_shards(
    model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: RunCheckpoint
) -> None:
    """A whole (single-file) checkpoint into a sharded run: every rank reads it and keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    optimizer_state = optimizer_state_by_name(optimizer, model, checkpoint.part("optimizer"))
    try:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=checkpoint.part("model"),
            optim_state_dict=optimizer_state,
            options=StateDictOptions(full_state_dict=True),
        )
    except Exception as error:
        raise CheckpointError(
            f"{checkpoint.path}: the model or optimizer state does not fit this run "
            f"({type(error).__name__}: {error}); use the config it was trained with"
        ) from None


def optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, model: nn.Module, state: Any
) -> dict[str, Any] | None:
    """A torch optimizer state_dict (parameters numbered in group order) keyed by parameter name
    instead, as torch.distributed.checkpoint's full state dicts are; the numbering follows this
    optimizer's groups, which the same config builds in the same order."""
    if not isinstance(state, dict) or not isinstance(state.get("param_groups"), list):
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    ours = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [i for group in state["param_groups"] for i in group["params"]]
    if len(saved) != len(ours):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} parameters, this run's {len(ours)}; "
            "use the config it was trained with"
        )
    fqn = {i: names[id(p)] for i, p in zip(saved, ours, strict=True)}
    return {
        "state": {fqn[i]: value for i, value in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in state["param_groups"]],
    }
