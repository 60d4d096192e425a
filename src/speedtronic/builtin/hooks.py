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


class WandbHook:
    """Logs to Weights & Biases; offline (no network, files under <output_dir>/wandb) without an API key."""

    def __init__(self, config: Config) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.hooks: the wandb hook needs wandb; pip install 'speedtronic-lm[wandb]'"
            ) from None
        from speedtronic.config import dump_config

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        out = Path(config.output_dir())
        out.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "speedtronic"),
            name=config.run.name,
            dir=str(out),
            mode=mode,
            config=dump_config(config),  # redacted: the token never reaches wandb
        )

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
