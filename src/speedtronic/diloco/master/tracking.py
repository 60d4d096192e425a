"""The swarm in the user's trackers: the DiLoCo master's record, sent once per outer step through the
hooks `logging.hooks` names (jsonl, tensorboard, wandb, or a plugin's), as `train` sends its own.

What one `outer_step` event carries (step = the outer step; TensorBoard and W&B show it under `swarm/`):
`val_loss` (the global model's held-out loss) and, where `run.eval_tasks` are scored, `eval/core` and
`eval/<task>`; totals `applied`, `rejected` (and `rejected_by/<check>`, per check that refused files),
`pending`, `tokens` and `bytes_in`; the round: `round_s` (time since the previous outer step of this
master), `wait_s` (how long the round waited once its first delta came), `closed_by` (what closed it:
all, grace, max_wait, not_live, min_deltas) and `without` (expected nodes it went ahead without);
per node `node/<id>/tokens`, `applied`, `rejected`, `bytes` and the node's own `val_loss`.

Where: the master's state directory (`distributed.master.state_dir`, default
`<output_dir>/diloco-master`): `tensorboard/`, `wandb/`, `metrics.jsonl` — never the directory of
the master's own training node, whose run logs there as any node's. W&B names it `<run>-swarm` in the
group `<run>`, beside the nodes' `<run>-<node>` runs.

What it reads: only the master's read-only views and its status document (report.status), after each
poll and on stop (`Report.watchers`, called by `Master.write_metrics`). It owns one small file, `tracking.json` (the last outer step it
logged), so a restarted master does not log the same steps twice. A tracker that fails is logged once
and switched off: the swarm never stops for a logger.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic.atomic_files import atomic_write_bytes

if TYPE_CHECKING:
    from speedtronic.config import Config
    from speedtronic.diloco.master.core import Master
    from speedtronic.engine.events import EventBus
    from speedtronic.registry import Registries

logger = logging.getLogger("speedtronic.diloco")

TRACKING_FILE = "tracking.json"
MAX_NODES = 256  # nodes with per-node series (a swarm of thousands would drown the tracker)


def tracker_config(config: Config, state_dir: str | Path) -> Config:
    """The master's tracking run: the run's config writing under the master's state directory."""
    from speedtronic.config import dump_config, load_config

    state = Path(state_dir)
    return load_config(
        dump_config(config, redact=False),
        [f"run.output_dir={state}", f"logging.json_file={state / 'metrics.jsonl'}"],
    )


def build_tracker_hooks(config: Config, registries: Registries | None = None) -> dict[str, Any]:
    """The hooks `logging.hooks` names, built for the swarm's run (W&B: `<run>-swarm` in group `<run>`)."""
    from speedtronic.builtin.hooks import Identity, TensorBoardHook, WandbHook
    from speedtronic.registry import resolve_registries

    registry = resolve_registries(registries).hooks
    run = config.run.name
    identity = Identity(f"{run}-swarm", run, ("diloco", "swarm", "role:master"))
    hooks: dict[str, Any] = {}
    for name in dict.fromkeys(config.logging.hooks):
        factory = registry.get(name)
        if factory is WandbHook:
            hooks[name] = WandbHook(config, identity)
        elif name == "tensorboard" and _is_builtin(factory):
            hooks[name] = TensorBoardHook(Path(config.output_dir()) / "tensorboard", identity)
        else:
            hooks[name] = factory(config)
    return hooks


def _is_builtin(factory: object) -> bool:
    return getattr(factory, "__module__", "") == "speedtronic.builtin.hooks"


class Tracking:
    """Sends the master's outer steps to the tracker hooks; `observe(master)` after each poll."""

    def __init__(self, events: EventBus, state_dir: str | Path) -> None:
        self.events = events
        self.path = Path(state_dir) / TRACKING_FILE
        self.logged = self._load()  # the last outer step sent (-1: none)
        self.stepped_at: float | None = None
        self.broken = False

    @classmethod
    def for_master(
        cls, config: Config, state_dir: str | Path, registries: Registries | None = None
    ) -> Tracking:
        from speedtronic.config import dump_config
        from speedtronic.engine.events import EventBus

        cfg = tracker_config(config, state_dir)
        events = EventBus(build_tracker_hooks(cfg, registries))
        events.emit("train_start", {"step": 0, "role": "swarm", "config": dump_config(cfg)})  # redacted
        return cls(events, state_dir)

    def _load(self) -> int:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8")[:4096])
            return int(data["outer_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def __call__(self, master: Master) -> None:
        self.observe(master)

    def observe(self, master: Master) -> None:
        """Log every outer step with a val loss (or the current one) not logged yet. Never raises."""
        if self.broken or not self.events.hooks:
            return
        step = master.outer_step
        losses = {s: v for s, v in master.val_losses if s > self.logged}
        if step <= self.logged and not losses:
            return
        try:
            for past in sorted(s for s in losses if s < step):
                self.events.emit("outer_step", {"step": past, "val_loss": losses[past]})
            if step > self.logged:
                self.events.emit("outer_step", self.payload(master, losses.get(step)))
            self.logged = max(self.logged, step, *losses)
            atomic_write_bytes(self.path, json.dumps({"outer_step": self.logged}).encode())
        except Exception as error:  # a tracker never stops the swarm
            self.broken = True
            logger.warning(
                "DiLoCo master: swarm tracking is off from here (%s: %s)", type(error).__name__, error
            )

    def payload(self, master: Master, val_loss: float | None) -> dict[str, Any]:
        """One outer step's metrics, from the status document and the round that closed it."""
        doc = master.status()
        step = master.outer_step
        out: dict[str, Any] = {"step": step}
        if val_loss is not None:
            out["val_loss"] = val_loss
        out.update(_eval(doc.get("global_eval_tasks")))
        out.update({k: doc.get(k) for k in ("applied", "rejected", "pending", "bytes_in")})
        out.update({f"rejected_by/{check}": n for check, n in (doc.get("rejected_by_check") or {}).items()})
        out.update(self._round(master))
        nodes = doc.get("nodes") or {}
        out["tokens"] = sum(int(n.get("tokens") or 0) for n in nodes.values())
        for node, entry in list(nodes.items())[:MAX_NODES]:
            out.update(_node(node, entry))
        return out

    def _round(self, master: Master) -> dict[str, Any]:
        out: dict[str, Any] = {}
        stepped = master.report.stepped_at
        if stepped is not None and self.stepped_at is not None and stepped > self.stepped_at:
            out["round_s"] = round(stepped - self.stepped_at, 3)
        self.stepped_at = stepped
        last = master.rounds.last or {}
        if last.get("outer_step") == master.outer_step:
            out["wait_s"] = last.get("waited_s")
            out["closed_by"] = last.get("closed_by")
            out["without"] = len(last.get("without") or [])
        return out

    def close(self) -> None:
        self.events.emit("train_end", {"step": max(self.logged, 0)})
        self.events.close()


def _eval(tasks: object) -> dict[str, float]:
    """`run.eval_tasks` of the global model ({"core", "tasks": {name: accuracy or {accuracy}}})."""
    if not isinstance(tasks, dict):
        return {}
    out: dict[str, float] = {}
    if isinstance(tasks.get("core"), (int, float)):
        out["eval/core"] = float(tasks["core"])
    results = tasks.get("tasks")
    for name, result in (results if isinstance(results, dict) else {}).items():
        value = result.get("accuracy") if isinstance(result, dict) else result
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"eval/{name}"] = float(value)
    return out


def _node(node: str, entry: dict[str, Any]) -> dict[str, Any]:
    # A node known with nothing applied yet is logged at 0, not left out (its series starts when it is known).
    out = {f"node/{node}/{k}": entry.get(k) or 0 for k in ("tokens", "applied", "rejected", "bytes")}
    own = entry.get("eval") if isinstance(entry.get("eval"), dict) else {}
    if isinstance(own.get("val_loss"), (int, float)):
        out[f"node/{node}/val_loss"] = own["val_loss"]
    return out
