"""What a person watching a run sees: a rich progress bar with live loss and tokens/s on a terminal,
plain log lines otherwise. It is an ordinary event hook, so the trainer knows nothing of terminals.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

logger = logging.getLogger("speedtronic.train")


class ProgressReporter:
    def __init__(self, total_steps: int, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or Console(stderr=True)
        self.total = total_steps
        self.bar: Progress | None = None
        self.task: Any = None
        self.live = enabled and self.console.is_terminal

    def on_train_start(self, payload: dict[str, Any]) -> None:
        for line in payload.get("summary", []):
            logger.info(line)
        if self.live:
            self.bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task(
                "train", total=self.total, completed=payload.get("step", 0), status=""
            )

    def on_step(self, payload: dict[str, Any]) -> None:
        status = f"loss {payload['loss']:.4f} · {payload['tokens_per_s']:,.0f} tok/s · lr {payload['lr']:.2e}"
        if self.bar is not None:
            self.bar.update(self.task, completed=payload["step"], status=status)
        else:
            extra = f" · mfu {payload['mfu']:.1%}" if payload.get("mfu") is not None else ""
            logger.info(
                "step %d/%d · %s · grad norm %.3f%s",
                payload["step"],
                self.total,
                status,
                payload.get("grad_norm") or math.nan,
                extra,
            )

    def on_eval(self, payload: dict[str, Any]) -> None:
        message = (
            f"eval step {payload['step']}: val loss {payload['val_loss']:.4f} · ppl {payload['val_ppl']:.2f}"
        )
        (self.bar.console.print if self.bar is not None else logger.info)(message)

    def on_checkpoint(self, payload: dict[str, Any]) -> None:
        message = f"checkpoint step {payload['step']} → {payload['path']}"
        (self.bar.console.print if self.bar is not None else logger.info)(message)

    def on_train_end(self, payload: dict[str, Any]) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
