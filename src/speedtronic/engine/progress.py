"""What a person watching a run sees: a progress bar with live loss and tokens/s on a terminal, plain
timestamped log lines otherwise, and a summary at the end. It is an ordinary event hook, so the trainer
knows nothing of terminals.

The bar advances on every step (the cheap `step_end` event, which carries no device value, so it never
makes the host wait for the GPU); loss, lr and tokens/s change on logging steps. It says "compiling…"
while the first compiled step runs, and ends at the step the run really stopped at. Everything else —
log records, eval and checkpoint lines — goes through the `speedtronic` logger, whose handler prints on
the bar's own console (engine/logs.py), so a line is printed above the bar, never glued onto it.
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

from speedtronic.engine.logs import run_console

logger = logging.getLogger("speedtronic.train")


class ProgressReporter:
    def __init__(self, total_steps: int, console: Console | None = None, enabled: bool = True) -> None:
        self.console = console or run_console()
        self.total = total_steps
        self.bar: Progress | None = None
        self.task: Any = None
        self.live = enabled and self.console.is_terminal
        self.status = ""

    def on_train_start(self, payload: dict[str, Any]) -> None:
        for line in payload.get("summary", []):
            logger.info(line)
        compiling = bool(payload.get("compiling"))
        if compiling:
            logger.info("torch.compile: compiling the first step (this can take a minute)…")
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
            self.status = "compiling…" if compiling else ""
            self.task = self.bar.add_task(
                "train", total=self.total, completed=payload.get("step", 0), status=self.status
            )

    def on_step_end(self, payload: dict[str, Any]) -> None:
        """Every step: move the bar (no device value is read)."""
        if self.bar is not None:
            if self.status == "compiling…":
                self.status = ""
            self.bar.update(self.task, completed=payload["step"], status=self.status)

    def on_step(self, payload: dict[str, Any]) -> None:
        status = f"loss {payload['loss']:.4f} · {payload['tokens_per_s']:,.0f} tok/s · lr {payload['lr']:.2e}"
        if self.bar is not None:
            self.status = status
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
        parts = []
        if payload.get("val_loss") is not None:
            parts.append(f"val loss {payload['val_loss']:.4f} · ppl {payload['val_ppl']:.2f}")
        if payload.get("core") is not None:  # run.eval_tasks
            accuracies = ", ".join(f"{name} {r['accuracy']:.3f}" for name, r in payload["tasks"].items())
            parts.append(f"tasks CORE {payload['core']:+.3f} ({accuracies})")
        logger.info("eval step %d: %s", payload["step"], " · ".join(parts))

    def on_checkpoint(self, payload: dict[str, Any]) -> None:
        logger.info("checkpoint step %d → %s", payload["step"], payload["path"])

    def on_train_end(self, payload: dict[str, Any]) -> None:
        steps = payload.get("steps")
        if self.bar is not None and steps is not None:  # end at the real total, not the planned one
            self.bar.update(self.task, total=max(steps, 1), completed=steps)
        self.close()
        for line in summary_lines(payload):
            logger.info(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def summary_lines(result: dict[str, Any]) -> list[str]:
    """The end of a run in a few lines: what was trained, where the time went, what came out of it."""
    lines = []
    state = "interrupted" if result.get("interrupted") else "finished"
    loss = result.get("final_loss")
    lines.append(
        f"{state} at step {result.get('steps')} · {result.get('tokens', 0):,} tokens"
        + (f" · train loss {loss:.4f}" if loss is not None else "")
        + (f" · val loss {result['val_loss']:.4f}" if result.get("val_loss") is not None else "")
        + (
            f" · best val loss {result['best_val_loss']:.4f}"
            if result.get("best_val_loss") is not None
            else ""
        )
    )
    times = result.get("time_split") or {}
    elapsed = result.get("elapsed_s") or 0.0
    split = " · ".join(f"{name} {seconds:.1f}s" for name, seconds in times.items() if seconds)
    lines.append(
        f"time {elapsed:.1f}s"
        + (f" ({split})" if split else "")
        + f" · {result.get('tokens_per_s', 0):,.0f} tok/s"
    )
    memory = result.get("peak_memory_bytes")
    if memory:
        lines.append(f"peak memory {memory / 2**20:,.0f} MiB ({result.get('peak_memory_kind') or 'process'})")
    where = [f"checkpoint {result['checkpoint']}"] if result.get("checkpoint") else []
    if result.get("metrics_path"):
        where.append(f"metrics {result['metrics_path']} (speedtronic runs shows them)")
    if where:
        lines.append(" · ".join(where))
    return lines
