"""Built-in training hooks, selected by name in `logging.hooks`: jsonl, tensorboard, wandb.

Each receives the trainer's events (train_start, step, eval, checkpoint, train_end) as dicts of
JSON-able values, and a DiLoCo master's `outer_step` events (diloco/master/tracking.py: the swarm's
metrics, one event per outer step, logged under `swarm/`). Optional back-ends import their package
inside the factory and fail with the install command when it is missing.

A DiLoCo node's run says which node and which run it is (`Identity`): W&B gets the name
`<run>-<node>`, the group `<run>` and tags `node:<id>`, `role:<role>`; TensorBoard a `run` text.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic.errors import ConfigError
from speedtronic.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from speedtronic.config import Config


SWARM = "swarm"  # the prefix of a master's outer_step metrics in TensorBoard and W&B


@dataclass(frozen=True)
class Identity:
    """Which run a tracker run belongs to: its name, its group (the DiLoCo run) and tags."""

    name: str
    group: str | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, config: Config) -> Identity:
        """A plain run: its name. A DiLoCo node (distributed.enabled): `<run>-<node>` in the group
        `<run>`, tagged with its node id and role, so every node of a swarm lands in one place."""
        dist = config.distributed
        if not dist.enabled or not dist.node.id:
            return cls(config.run.name)
        node, role = dist.node.id, dist.node.resolved_role()
        return cls(f"{config.run.name}-{node}", config.run.name, ("diloco", f"node:{node}", f"role:{role}"))

    def text(self) -> str:
        tags = ", ".join(self.tags)
        return (
            f"run {self.name}"
            + (f" · group {self.group}" if self.group else "")
            + (f" · {tags}" if tags else "")
        )


def _numbers(payload: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in payload.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class JsonlHook:
    """Appends one JSON object per event to the metrics file (default <output_dir>/metrics.jsonl)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line-buffered append: a crash loses at most the line being written, never earlier ones.
        self._file = self.path.open("a", encoding="utf-8", buffering=1)

    def _write(self, event: str, payload: dict[str, Any]) -> None:
        self._file.write(json.dumps({"event": event, **payload}, default=str) + "\n")

    def on_train_start(self, payload: dict[str, Any]) -> None:
        self._write("train_start", payload)

    def on_step(self, payload: dict[str, Any]) -> None:
        self._write("step", payload)

    def on_eval(self, payload: dict[str, Any]) -> None:
        self._write("eval", payload)

    def on_checkpoint(self, payload: dict[str, Any]) -> None:
        self._write("checkpoint", payload)

    def on_train_end(self, payload: dict[str, Any]) -> None:
        self._write("train_end", payload)

    def on_outer_step(self, payload: dict[str, Any]) -> None:
        self._write("outer_step", payload)

    def close(self) -> None:
        self._file.close()


class TensorBoardHook:
    """Writes scalar metrics as TensorBoard event files under <output_dir>/tensorboard."""

    def __init__(self, log_dir: str | Path, identity: Identity | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "logging.hooks: the tensorboard hook needs the tensorboard package; "
                "pip install 'speedtronic-lm[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))
        if identity is not None and identity.group:  # a DiLoCo node: which node of which run
            self.writer.add_text("run", identity.text(), 0)

    def _scalars(self, prefix: str, payload: dict[str, Any]) -> None:
        step = int(payload.get("step", 0))
        for key, value in _numbers(payload).items():
            self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def on_outer_step(self, payload: dict[str, Any]) -> None:
        self._scalars(SWARM, payload)
        if isinstance(payload.get("closed_by"), str):  # what the round waited for, as text
            self.writer.add_text(f"{SWARM}/closed_by", payload["closed_by"], int(payload.get("step", 0)))

    def on_step(self, payload: dict[str, Any]) -> None:
        self._scalars("train", payload)

    def on_eval(self, payload: dict[str, Any]) -> None:
        self._scalars("val", payload)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def wandb_mode(wandb: Any) -> str:
    """WANDB_MODE when set; else online when W&B has a key (WANDB_API_KEY or a `wandb login`), offline
    otherwise, so a run never stops to ask for a login."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        logged_in = bool(wandb.api.api_key)  # reads the key `wandb login` stored (~/.netrc)
    except Exception:
        logged_in = False
    return "online" if logged_in else "offline"


def _run_id() -> str:
    """A new W&B run id: 8 lowercase letters and digits (as W&B makes them; its helper moved in 0.2x)."""
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbHook:
    """Logs to Weights & Biases: online when logged in, offline files under <output_dir>/wandb otherwise;
    a resumed run continues the same W&B run (its id is kept in <output_dir>/wandb-run-id)."""

    def __init__(self, config: Config, identity: Identity | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.hooks: the wandb hook needs wandb; pip install 'speedtronic-lm[wandb]'"
            ) from None
        from speedtronic.config import dump_config

        out = Path(config.output_dir())
        out.mkdir(parents=True, exist_ok=True)
        # One W&B run per speedtronic run: its id is kept next to the metrics, so a resume continues it.
        id_file = out / "wandb-run-id"
        run_id = id_file.read_text(encoding="utf-8").strip() if id_file.is_file() else ""
        if not run_id:
            run_id = _run_id()
            id_file.write_text(run_id + "\n", encoding="utf-8")
        identity = identity or Identity.of(config)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "speedtronic"),
            name=identity.name,
            group=identity.group,
            tags=list(identity.tags) or None,
            # A master that trains has two W&B runs in one process (its node's and the swarm's).
            reinit="create_new",
            id=run_id,
            resume="allow",
            dir=str(out),
            mode=wandb_mode(wandb),
            config=dump_config(config),  # redacted: the token never reaches wandb
        )
        self.log_dir = str(out / "wandb")

    def on_step(self, payload: dict[str, Any]) -> None:
        self.run.log({f"train/{k}": v for k, v in payload.items() if k != "step"}, step=payload.get("step"))

    def on_eval(self, payload: dict[str, Any]) -> None:
        self.run.log({f"val/{k}": v for k, v in payload.items() if k != "step"}, step=payload.get("step"))

    def on_outer_step(self, payload: dict[str, Any]) -> None:
        logged = {f"{SWARM}/{k}": v for k, v in _numbers(payload).items()}
        if isinstance(payload.get("closed_by"), str):
            logged[f"{SWARM}/closed_by"] = payload["closed_by"]
        self.run.log(logged, step=payload.get("step"))

    def close(self) -> None:
        self.run.finish()


@hookimpl
def register_hooks(register: Register) -> None:
    register("jsonl", lambda config: JsonlHook(config.metrics_file()))
    register(
        "tensorboard",
        lambda config: TensorBoardHook(Path(config.output_dir()) / "tensorboard", Identity.of(config)),
    )
    register("wandb", WandbHook)
