"""The trainer's contract with models and data: batch layouts in, a scalar loss out.

Batches may be mappings (`input_ids`, `labels`, optional `attention_mask`) or `(inputs, labels)`
tuples. Models may return a loss tensor, a mapping with "loss", a tuple whose first element is the
loss, or plain logits — then the causal LM loss is computed here, with labels the data pipeline has
already shifted (labels[t] is the target at position t), so nothing is shifted twice.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def split_batch(batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(model inputs, labels) from a mapping or an (inputs, labels) tuple."""
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if "input_ids" not in inputs:
            raise ValueError(f"a batch mapping needs 'input_ids'; got keys {sorted(batch)}")
        return inputs, batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return {"input_ids": batch[0]}, batch[1]
    raise TypeError(f"a batch must be a mapping or an (inputs, labels) pair, not {type(batch).__name__}")


def move_batch(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(batch, Mapping):
        return {
            k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for k, v in batch.items()
        }
    if isinstance(batch, (tuple, list)):
        return type(batch)(
            v.to(device, non_blocking=non_blocking) if torch.is_tensor(v) else v for v in batch
        )
    return batch


def accepts_labels(model: nn.Module) -> bool:
    """Whether model.forward takes a `labels` argument (then the model computes its own loss)."""
    forward = getattr(model, "_orig_mod", model).forward
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return "labels" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of already-shifted labels, in float32 for a stable softmax."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


def forward_loss(model: nn.Module, batch: Any, pass_labels: bool) -> torch.Tensor:
    """Run the model on one batch and return the scalar loss, whatever the model's return convention."""
    inputs, labels = split_batch(batch)
    output = model(**inputs, labels=labels) if pass_labels and labels is not None else model(**inputs)
    return loss_from_output(output, labels)


def loss_from_output(output: Any, labels: torch.Tensor | None) -> torch.Tensor:
    if isinstance(output, Mapping):
        if output.get("loss") is not None:
            return output["loss"]
        if output.get("logits") is not None:
            return _loss_from_logits(output["logits"], labels)
        raise TypeError(f"the model returned a mapping without 'loss' or 'logits' (keys {sorted(output)})")
    if isinstance(output, (tuple, list)):
        if not output:
            raise TypeError("the model returned an empty tuple")
        first = output[0]
        if torch.is_tensor(first) and first.ndim == 0:
            return first
        return loss_from_output(first, labels)
    if torch.is_tensor(output):
        return output if output.ndim == 0 else _loss_from_logits(output, labels)
    raise TypeError(f"the model returned {type(output).__name__}; expected a loss, logits, mapping or tuple")


def _loss_from_logits(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    if labels is None:
        raise ValueError("the model returned logits but the batch has no labels to compute a loss with")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    return causal_lm_loss(logits, labels)
