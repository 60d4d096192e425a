"""Each node's own evaluation, next to the global model's in `hub status`.

A worker evaluates its local model every `run.eval_every` steps (val loss, and `run.eval_tasks`'
accuracies with their CORE aggregate: engine/eval_during.py). `Recorder`, a training hook that
diloco/launch.py adds to a worker's trainer, keeps a small summary of the latest evaluation, and the
coordinator sends it in every delta's metadata (key "eval", JSON); the master keeps the latest per
node with its last applied delta (master.nodes, so its state and head.json carry it) and its status
document shows it (master_report.py, `hub status`). The global model's own results (the master's
evaluator, diloco/launch.py) are summarised the same way.

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
from typing import Any

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


class Recorder:
    """A training hook: each `eval` event's summary becomes the delta metadata the coordinator sends."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    def on_eval(self, payload: dict[str, Any]) -> None:
        text = json.dumps(summary(payload), separators=(",", ":"))
        if len(text) <= MAX_CHARS:
            self.coordinator.eval_meta = {"eval": text}


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
    """The global model's results in the nodes' shape (the master's evaluator: launch.make_evaluator)."""
    if val_loss is None and not isinstance(tasks, dict):
        return None
    payload = {"step": max(0, int(outer_step or 0)), "val_loss": val_loss, **(tasks or {})}
    return summary(payload)


def _number(value: Any) -> float | None:
    return float(value) if _finite(value) else None


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
