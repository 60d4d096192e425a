"""`speedtronic runs` reads runs/<name>/metrics.jsonl back: a table (and --json) over every run, and
loss-curve plots in the terminal and as a PNG (matplotlib, the `plot` extra)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from speedtronic.runs import summarize, text_plot

TINY = ["--set", "run.log_every=2", "--set", "run.eval_every=4", "--set", "checkpoint.enabled=false"]


@pytest.fixture
def two_runs(run_cli, tmp_path: Path) -> Path:
    for name, optimizer in (("adam", "adamw"), ("muon", "muon")):
        result = run_cli(
            "train", "smoke", "--max-steps", "8", "--set", f"run.name={name}",
            "--set", f"optimizer.name={optimizer}", *TINY,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    return tmp_path


def test_runs_table_and_json(run_cli, two_runs: Path) -> None:
    listed = run_cli("runs", "--json")
    assert listed.returncode == 0, listed.stderr
    runs = {run["name"]: run for run in json.loads(listed.stdout.splitlines()[-1])}
    assert set(runs) == {"adam", "muon"}
    adam = runs["adam"]
    assert adam["steps"] == 8 and adam["tokens"] == 8 * 8 * 64
    assert adam["optimizer"] == "adamw" and adam["lr"] == 0.003 and runs["muon"]["optimizer"] == "muon"
    assert adam["best_val_loss"] <= adam["final_val_loss"] and adam["final_loss"] > 0
    assert adam["tokens_per_s"] > 0 and adam["wall_s"] > 0 and adam["finished"] is True
    table = run_cli("runs")
    assert table.returncode == 0, table.stderr
    header = next(line for line in table.stdout.splitlines() if "best val" in line)
    for column in ("run", "steps", "tokens", "val loss", "tok/s", "wall", "optimizer", "lr"):
        assert column in header
    assert any("adam" in line and "adamw" in line and "4,096" in line for line in table.stdout.splitlines())


def test_runs_plot_in_the_terminal_and_as_a_png(run_cli, two_runs: Path) -> None:
    text = run_cli("runs", "plot", "adam", "muon")
    assert text.returncode == 0, text.stderr
    assert "train loss by step" in text.stdout and "* adam" in text.stdout and "o muon" in text.stdout
    pytest.importorskip("matplotlib")
    image = run_cli("runs", "plot", "adam", "runs/muon", "--out", "plots/curves.png", "--json")
    assert image.returncode == 0, image.stderr
    assert json.loads(image.stdout.splitlines()[-1])["runs"] == ["adam", "muon"]
    data = (two_runs / "plots" / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 600 <= width <= 3000 and 400 <= height <= 2000 and len(data) > 10_000


def test_an_unknown_run_is_a_usage_error_listing_the_runs(run_cli, two_runs: Path) -> None:
    result = run_cli("runs", "plot", "nope")
    assert result.returncode == 2 and "adam" in result.stderr and "muon" in result.stderr


def test_a_resumed_run_is_one_run_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    events = [
        {"event": "train_start", "config": {"optimizer": {"name": "adamw", "lr": 0.01}}},
        {"event": "step", "step": 2, "loss": 3.0, "tokens_seen": 20},
        {"event": "step", "step": 4, "loss": 2.5, "tokens_seen": 40},
        {"event": "eval", "step": 4, "val_loss": 2.6},
        {
            "event": "train_end",
            "steps": 4,
            "tokens": 40,
            "elapsed_s": 10.0,
            "tokens_per_s": 4.0,
            "interrupted": True,
        },
        {"event": "train_start", "config": {"optimizer": {"name": "adamw", "lr": 0.01}}},
        {"event": "step", "step": 6, "loss": 2.0, "tokens_seen": 60},
        {"event": "eval", "step": 6, "val_loss": 2.7},
        {"event": "train_end", "steps": 6, "tokens": 60, "elapsed_s": 5.0, "tokens_per_s": 4.0},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(map(json.dumps, events)) + '\n{"event": "st', encoding="utf-8")
    run = summarize("r", path)
    assert (run.steps, run.tokens, run.wall_s, run.finished) == (6, 60, 15.0, True)
    assert run.train == [(2, 3.0), (4, 2.5), (6, 2.0)]
    assert (run.final_val_loss, run.best_val_loss, run.lr) == (2.7, 2.6, 0.01)
    assert "* r" in text_plot([run])
