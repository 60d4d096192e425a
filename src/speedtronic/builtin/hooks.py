"""Built-in training hooks, selected by name in `logging.hooks`: jsonl, tensorboard, wandb.

Each receives the trainer's events (train_start, step, eval, checkpoint, train_end) as dicts of
JSON-able values. Optional back-ends import their package inside the factory and fail with the
install command when it is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic.errors import ConfigError
from speedtronic.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from speedtronic.config import Config


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

    def close(self) -> None:
        self._file.close()


class TensorBoardHook:
    """Writes scalar metrics as TensorBoard event files under <output_dir>/tensorboard."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "logging.hooks: the tensorboard hook needs the tensorboard package; "
                "pip install 'speedtronic-lm[tensorboard]'"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def _scalars(self, prefix: str, payload: dict[str, Any]) -> None:
        step = int(payload.get("step", 0))
        for key, value in payload.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

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


class WandbHook:
    """Logs to Weights & Biases: online when logged in, offline files under <output_dir>/wandb otherwise;
    a resumed run continues the same W&B run (its id is kept in <output_dir>/wandb-run-id)."""

    def __init__(self, config: Config) -> None:
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
            run_id = wandb.util.generate_id()
            id_file.write_text(run_id + "\n", encoding="utf-8")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "speedtronic"),
            name=config.run.name,
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

    def close(self) -> None:
        self.run.finish()


@hookimpl
def register_hooks(register: Register) -> None:
    register("jsonl", lambda config: JsonlHook(config.metrics_file()))
    register("tensorboard", lambda config: TensorBoardHook(Path(config.output_dir()) / "tensorboard"))
    register("wandb", WandbHook)
