"""Each node's own evaluation, next to the global model's in `hub status`.

A worker evaluates its local model every `run.eval_every` steps (val loss, and `run.eval_tasks`'
accuracies with their CORE aggregate: engine/eval/during_training.py). `Recorder`, a training hook that
diloco/launch.py adds to a worker's trainer, keeps a small summary of the latest evaluation, and the
coordinator sends it in every delta's metadata (key "eval", JSON); the master keeps the latest per
node with its last applied delta (master.nodes, so its state and head.json carry it) and its status
document shows it (master/report.py, `hub status`). The global model's own results (the master's
`Evaluator`, below) are summarised the same way.

Whatever a delta says is untrusted: `read` accepts only a JSON object of at most MAX_CHARS
characters with an integer step, finite numbers, and at most MAX_TASKS tasks with short plain names
and accuracies in [0, 1]; anything else is dropped (never a reason to reject the delta itself, whose
weights are judged on their own). The summary is the node's *local* model at its last evaluation
(the step says which), before the global it later installs.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from speedtronic.config import Config
    from speedtronic.engine.data import DataBundle
    from speedtronic.engine.eval.during_training import TaskEval
    from speedtronic.plan import RunPlan

MAX_CHARS = 4096
MAX_TASKS = 16
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,63}")


def summary(payload: dict[str, Any]) -> dict[str, Any]:
    """{step, val_loss, core, tasks: {name: accuracy}} of an `eval` event's payload (bounded)."""
    tasks = payload.get("tasks") or {}
    return {
        "step": int(payload.get("step", 0)),
        "val_loss": _number(payload.get("val_loss")),
        "core": _number(payload.get("core")),
        "tasks": {
            str(name): _number(r.get("accuracy"))
            for name, r in list(tasks.items())[:MAX_TASKS]
            if isinstance(r, dict) and _NAME.fullmatch(str(name))
        },
    }


class EvalSink(Protocol):
    """Where a node's evaluation summary goes: the worker's coordinator (diloco/worker/coordinator.py)."""

    def record_eval(self, meta: dict[str, str]) -> None: ...


class Recorder:
    """A training hook: each `eval` event's summary becomes the delta metadata the coordinator sends."""

    def __init__(self, coordinator: EvalSink) -> None:
        self.coordinator = coordinator

    def on_eval(self, payload: dict[str, Any]) -> None:
        text = json.dumps(summary(payload), separators=(",", ":"))
        if len(text) <= MAX_CHARS:
            self.coordinator.record_eval({"eval": text})


class Evaluator:
    """The master's view of the global model: its validation loss (call it with the weights) and, with
    `run.eval_tasks`, the tasks' scores of the last full evaluation (`tasks`, shown beside the nodes'
    in the status). The weights are copied into `model` (the reference model, whose own weights nothing
    reads after the master snapshots them) and scored on the val batches."""

    def __init__(
        self, model: nn.Module, batches: list[dict[str, torch.Tensor]], tasks: TaskEval | None
    ) -> None:
        from speedtronic.engine.batches import accepts_labels

        self.model = model
        self.batches = batches
        self.labels = accepts_labels(model)
        self.task_eval = tasks
        self.tasks: dict[str, Any] | None = None  # the last full evaluation's task scores

    @classmethod
    def for_run(cls, cfg: Config, model: nn.Module, bundle: DataBundle, plan: RunPlan) -> Evaluator | None:
        """The run's evaluator, or None without validation batches; `plan`: the one the reference
        model was built with (launch.build_reference), not planned again."""
        batches = list(bundle.val_batches())
        if not batches:
            return None
        return cls(model, batches, _task_eval(cfg, plan))

    def __call__(self, weights: dict[str, torch.Tensor], with_tasks: bool = True) -> float:
        import torch

        from speedtronic.diloco.codec import unique_params
        from speedtronic.engine.batches import forward_loss

        with torch.no_grad():
            for name, p in unique_params(self.model).items():
                p.copy_(weights[name])
            self.model.eval()
            if self.task_eval is not None and with_tasks:  # the loss probe needs the loss only
                self.tasks = self.task_eval.score(self.model)
            losses = (forward_loss(self.model, b, self.labels).float().item() for b in self.batches)
            return sum(losses) / len(self.batches)

    def loss_only(self, weights: dict[str, torch.Tensor]) -> float:
        """The validation loss alone (the loss probe has no use for the task scores)."""
        return self(weights, with_tasks=False)


def _task_eval(cfg: Config, plan: RunPlan) -> TaskEval | None:
    """run.eval_tasks, scored on the global model too (engine/eval/during_training.py)."""
    from speedtronic.engine.eval.during_training import TaskEval

    return TaskEval.for_run(cfg, plan) if cfg.run.eval_tasks else None


def read(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The node's summary from a delta's metadata, validated (see the module doc), or None."""
    raw = meta.get("eval")
    if not isinstance(raw, str) or len(raw) > MAX_CHARS:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return valid(data)


def valid(data: Any) -> dict[str, Any] | None:
    """`data` if it is a well-formed summary (a copy with only the known keys), else None."""
    if not isinstance(data, dict):
        return None
    step, tasks = data.get("step"), data.get("tasks")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(tasks, dict):
        return None
    if len(tasks) > MAX_TASKS:
        return None
    out: dict[str, Any] = {"step": step, "val_loss": None, "core": None, "tasks": {}}
    for key, low, high in (("val_loss", 0.0, 1e4), ("core", -1e4, 1.0)):
        value = data.get(key)
        if value is not None:
            if not _finite(value) or not low <= value <= high:
                return None
            out[key] = float(value)
    for name, value in tasks.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            return None
        if value is not None and (not _finite(value) or not 0.0 <= value <= 1.0):
            return None
        out["tasks"][name] = None if value is None else float(value)
    return out


def global_summary(outer_step: int | None, val_loss: float | None, tasks: Any) -> dict[str, Any] | None:
    """The global model's results in the nodes' shape (the master's `Evaluator`)."""
    if val_loss is None and not isinstance(tasks, dict):
        return None
    payload = {"step": max(0, int(outer_step or 0)), "val_loss": val_loss, **(tasks or {})}
    return summary(payload)


def _number(value: Any) -> float | None:
    return float(value) if _finite(value) else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
