"""A training hook, registered by the plugin as "csv": writes step and eval metrics to a CSV file.

Select it with `logging.hooks: [jsonl, csv]`; the file is `<output_dir>/metrics.csv`. The columns are
fixed (a spreadsheet wants one header), and cells a given event does not have stay empty:

    step,event,loss,lr,grad_norm,tokens_per_s,val_loss,val_ppl
    10,step,5.41,0.003,1.2,51234.5,,
    30,eval,,,,,5.02,151.4

A hook is any object with some of `on_train_start/on_step/on_eval/on_checkpoint/on_train_end(payload)`
and `close()`; the trainer calls those that exist. Standard library only: no torch here.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from speedtronic.config import Config

COLUMNS = ("step", "event", "loss", "lr", "grad_norm", "tokens_per_s", "val_loss", "val_ppl")


class CsvHook:
    """Appends one row per step and eval event to a CSV file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append, so a resumed run continues the same file; the header goes only into a new one.
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        # Line-buffered: a crash loses at most the row being written, and `tail -f` shows progress.
        self._file = self.path.open("a", encoding="utf-8", newline="", buffering=1)
        # Payload keys outside COLUMNS (mfu, memory, ...) are dropped; missing ones become empty cells.
        self._writer = csv.DictWriter(
            self._file, fieldnames=COLUMNS, restval="", extrasaction="ignore", lineterminator="\n"
        )
        if is_new:
            self._writer.writeheader()

    def _write(self, event: str, payload: dict[str, Any]) -> None:
        # None (e.g. grad_norm without clipping) is written as an empty cell by the csv module.
        self._writer.writerow({**payload, "event": event})

    def on_step(self, payload: dict[str, Any]) -> None:
        self._write("step", payload)

    def on_eval(self, payload: dict[str, Any]) -> None:
        self._write("eval", payload)

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def build_csv_hook(config: Config) -> CsvHook:
    """The registered factory's body: a CsvHook writing into the run's output directory."""
    return CsvHook(Path(config.output_dir()) / "metrics.csv")
