"""Tests of the csv training hook (hooks.py): header, fixed columns, empty cells, resume."""

from __future__ import annotations

import csv
from pathlib import Path

from speedtronic.config import load_config

from speedtronic_example.hooks import COLUMNS, CsvHook, build_csv_hook


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_writes_header_and_one_row_per_event(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.csv"
    hook = CsvHook(path)
    hook.on_step({"step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 100.0, "mfu": 0.1})
    hook.on_eval({"step": 1, "val_loss": 5.0, "val_ppl": 148.4})
    hook.close()
    assert path.read_text(encoding="utf-8").splitlines()[0] == ",".join(COLUMNS)
    step, val = rows(path)
    assert step == {
        "step": "1",
        "event": "step",
        "loss": "5.5",
        "lr": "0.001",
        "grad_norm": "",
        "tokens_per_s": "100.0",
        "val_loss": "",
        "val_ppl": "",
    }  # mfu is not a column
    assert val["event"] == "eval" and val["val_loss"] == "5.0" and val["loss"] == ""


def test_reopening_appends_without_a_second_header(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    for step in (1, 2):  # e.g. a run resumed from its checkpoint
        hook = CsvHook(path)
        hook.on_step({"step": step, "loss": 1.0})
        hook.close()
    assert [r["step"] for r in rows(path)] == ["1", "2"]


def test_factory_writes_into_the_run_output_dir(tmp_path: Path) -> None:
    config = load_config({"run": {"name": "x", "output_dir": str(tmp_path / "out")}})
    hook = build_csv_hook(config)
    hook.close()
    assert hook.path == tmp_path / "out" / "metrics.csv"
