"""The trainer's contract with models and data: batch layouts in, a scalar loss out.

The contract is architecture-neutral: nothing here knows which model it runs.

Batches
    * a mapping with `input_ids` (and optionally `labels`, `attention_mask`, any other keys), or
    * a tuple/list `(inputs, labels, *extra)`.
    Labels are already shifted by the data pipeline (labels[t] is the target at position t), so
    nothing is shifted twice; -100 marks positions to ignore. `batch_tokens(batch)` counts the
    inputs' elements (the trainer's token count).

Calling the model — the convention is read once per model from its `forward` signature (cached, so
the training step pays a dictionary look-up, not an `inspect` call):
    * the inputs go in as the first positional argument whatever its name: `forward(input_ids)`,
      `forward(input_ids, labels)`, `forward(x)` all work; a forward with no positional parameter
      (`forward(**batch)`, or a keyword-only `input_ids`) gets them as `input_ids=`;
    * `labels=` is passed when the forward has a `labels` parameter (or `**kwargs`): the model then
      computes its own loss;
    * a mapping's other keys (`attention_mask`, …) are passed by keyword when the forward takes
      them (a parameter of that name, or `**kwargs`) and are ignored otherwise;
    * a tuple's extra items go, in order, to the forward's positional parameters after the first
      (`labels` skipped: it gets the labels), by name; extra items beyond those are ignored.

What the model returns — any of:
    * a scalar loss tensor;
    * logits `[B, T, vocab]` (the causal LM loss is computed here, in float32);
    * a mapping (a Hugging Face `ModelOutput` is one) or any object with `loss` / `logits`
      (the loss is used when present, else the logits);
    * a tuple whose first element is the loss, or the logits.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ForwardSpec:
    """How to call one model's forward (see the module doc), read from its signature once."""

    positional: bool  # the inputs are the first positional argument (else `input_ids=`)
    takes_any_keyword: bool  # **kwargs
    keywords: frozenset[str]  # parameter names that can be given by keyword
    extra_slots: tuple[str, ...]  # where a tuple batch's extra items go, in order
    labels: bool  # takes `labels`: the model computes its own loss

    def takes(self, name: str) -> bool:
        return self.takes_any_keyword or name in self.keywords


_KEYWORD_ONLY_INPUTS = ForwardSpec(False, False, frozenset({"input_ids"}), (), False)
_SPECS: weakref.WeakKeyDictionary[nn.Module, ForwardSpec] = weakref.WeakKeyDictionary()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose forward really runs: through torch.compile's and DDP's wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod  # type: ignore[assignment]
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def forward_spec(model: nn.Module) -> ForwardSpec:
    """The calling convention of `model` (compiled/DDP wrappers see through), computed once per model."""
    try:
        return _SPECS[model]
    except (KeyError, TypeError):
        pass
    spec = _read_spec(unwrap_model(model))
    with contextlib.suppress(TypeError):  # not weak-referenceable: recomputed each call (still correct)
        _SPECS[model] = spec
    return spec


def _read_spec(model: nn.Module) -> ForwardSpec:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return _KEYWORD_ONLY_INPUTS  # unreadable: the historical convention, input_ids by keyword
    kind = inspect.Parameter
    positional = [p for p in params if p.kind in (kind.POSITIONAL_ONLY, kind.POSITIONAL_OR_KEYWORD)]
    keywords = frozenset(p.name for p in params if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY))
    any_keyword = any(p.kind is kind.VAR_KEYWORD for p in params)
    slots = tuple(p.name for p in positional[1:] if p.name != "labels" and p.kind is not kind.POSITIONAL_ONLY)
    return ForwardSpec(
        positional=bool(positional),
        takes_any_keyword=any_keyword,
        keywords=keywords,
        extra_slots=slots,
        labels="labels" in keywords or any_keyword,
    )


def unpack_batch(batch: Any) -> tuple[dict[str, Any], torch.Tensor | None, tuple[Any, ...]]:
    """(model inputs with `input_ids`, labels, a tuple batch's extra items) of a batch."""
    if isinstance(batch, Mapping):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if "input_ids" not in inputs:
            raise ValueError(f"a batch mapping needs 'input_ids'; got keys {sorted(batch)}")
        return inputs, batch.get("labels"), ()
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return {"input_ids": batch[0]}, batch[1], tuple(batch[2:])
    raise TypeError(
        f"a batch must be a mapping or an (inputs, labels, *extra) tuple, not {type(batch).__name__}"
    )


def split_batch(batch: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(model inputs, labels) from a mapping or an (inputs, labels, *extra) tuple (extras left out)."""
    inputs, labels, _ = unpack_batch(batch)
    return inputs, labels


def batch_tokens(batch: Any) -> int:
    """Tokens in a batch: the elements of its inputs."""
    if isinstance(batch, Mapping):
        inputs = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        inputs = batch[0]
    else:
        inputs = None
    if not torch.is_tensor(inputs):
        return split_batch(batch)[0]["input_ids"].numel()  # raises the layout error
    return inputs.numel()


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
    return forward_spec(model).labels


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of already-shifted labels, in float32 for a stable softmax."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )


def call_model(model: nn.Module, batch: Any, pass_labels: bool) -> tuple[Any, torch.Tensor | None]:
    """Run the model on one batch by its calling convention; (its output, the batch's labels)."""
    spec = forward_spec(model)
    inputs, labels, extra = unpack_batch(batch)
    input_ids = inputs.pop("input_ids")
    kwargs = {k: v for k, v in inputs.items() if spec.takes(k)}
    for name, value in zip(spec.extra_slots, extra, strict=False):
        kwargs.setdefault(name, value)
    if pass_labels and labels is not None:
        kwargs["labels"] = labels
    if spec.positional:
        return model(input_ids, **kwargs), labels
    return model(input_ids=input_ids, **kwargs), labels


def forward_loss(model: nn.Module, batch: Any, pass_labels: bool) -> torch.Tensor:
    """Run the model on one batch and return the scalar loss, whatever the model's return convention."""
    output, labels = call_model(model, batch, pass_labels)
    return loss_from_output(output, labels)


def loss_from_output(output: Any, labels: torch.Tensor | None) -> torch.Tensor:
    if torch.is_tensor(output):
        return output if output.ndim == 0 else _loss_from_logits(output, labels)
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
    loss, logits = getattr(output, "loss", None), getattr(output, "logits", None)
    if loss is not None:
        return loss
    if logits is not None:
        return _loss_from_logits(logits, labels)
    raise TypeError(
        f"the model returned {type(output).__name__}; expected a loss, logits, a mapping or an object "
        "with loss/logits, or a tuple"
    )


def logits_from_output(output: Any) -> torch.Tensor:
    """The logits of a model's output, in any of the forms above (sampling's view of the contract)."""
    if torch.is_tensor(output):
        return output
    if isinstance(output, Mapping):
        logits = output.get("logits")
    elif isinstance(output, (tuple, list)) and output:
        first = output[0]
        logits = output[1] if torch.is_tensor(first) and first.ndim == 0 and len(output) > 1 else first
    else:
        logits = getattr(output, "logits", None)
    if not torch.is_tensor(logits):
        raise TypeError(f"the model returned {type(output).__name__} without logits to sample from")
    return logits


def _loss_from_logits(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    if labels is None:
        raise ValueError("the model returned logits but the batch has no labels to compute a loss with")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    return causal_lm_loss(logits, labels)
