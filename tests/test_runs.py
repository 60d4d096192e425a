"""`speedtronic runs` reads runs/<name>/metrics.jsonl back: a table (and --json) over every run, and
loss-curve plots in the terminal and as a PNG (matplotlib, the `plot` extra)."""

from __future__ import annotations

import json
import re
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
    runs = {run["name"]: run for run in json.loads(listed.stdout.splitlines()[-1])["runs"]}
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


# ----------------------------------------------------------------- --tensorboard / --wandb on train


def test_train_announces_the_metrics_and_the_tensorboard_flag_adds_its_hook(run_cli) -> None:
    result = run_cli("train", "smoke", "--max-steps", "2", "--tensorboard", *TINY)
    try:
        import tensorboard  # noqa: F401
    except ImportError:  # the flag selected the hook, which names the extra to install
        assert result.returncode == 2 and "speedtronic-lm[tensorboard]" in result.stderr, result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert "tensorboard: runs/smoke/tensorboard" in result.stderr
    plain = run_cli("train", "smoke", "--max-steps", "2", *TINY)
    assert "metrics: runs/smoke/metrics.jsonl" in plain.stderr


class FakeWandb:
    """Just what WandbHook uses of the wandb package: init, api.api_key (the run id is its own)."""

    def __init__(self, api_key: str | None) -> None:
        self.calls: list[dict] = []
        self.api = type("api", (), {"api_key": api_key})

    def init(self, **kwargs):
        self.calls.append(kwargs)
        return type("run", (), {"log": lambda *a, **k: None, "finish": lambda *a: None})()


@pytest.mark.parametrize(("api_key", "env", "mode"), [(None, {}, "offline"), ("k", {}, "online"),
                                                      (None, {"WANDB_API_KEY": "x"}, "online"),
                                                      ("k", {"WANDB_MODE": "disabled"}, "disabled")])  # fmt: skip
def test_wandb_decides_online_itself_and_a_resume_continues_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, api_key, env, mode
) -> None:
    from speedtronic.builtin.hooks import WandbHook
    from speedtronic.config import load_config

    fake = FakeWandb(api_key)
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = load_config("smoke", [f"run.output_dir={tmp_path / 'run'}"])
    WandbHook(config)
    WandbHook(config)  # the resumed run
    first, second = fake.calls
    assert first["mode"] == second["mode"] == mode
    assert first["id"] == second["id"] and first["resume"] == "allow"
    assert re.fullmatch(r"[a-z0-9]{8}", first["id"]), first["id"]  # as W&B makes run ids
    assert (tmp_path / "run" / "wandb-run-id").read_text().strip() == first["id"]
