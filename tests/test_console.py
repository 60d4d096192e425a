"""What a person sees while a run trains: one console for log records and the progress bar.

On a real terminal (a pty) no log line ever shares a screen line with the bar, the bar ends at the
step the run stopped at, and the end summary says where the time and the metrics went. With stderr
in a file every event is one timestamped line, never wrapped, whatever the terminal width.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC_DIR, TOKEN_VARIABLES

# A short run that logs, evaluates and checkpoints while the bar is live.
RUN = [
    "train",
    "smoke",
    "--max-steps",
    "12",
    "--set",
    "run.log_every=4",
    "--set",
    "run.eval_every=6",
    "--set",
    "checkpoint.every_steps=4",
]
CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def screen(output: str) -> list[str]:
    """The terminal's lines (scrollback included) after `output`: text, \\r, \\n, cursor up, erase line."""
    lines: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(output):
        char = output[i]
        match = CSI.match(output, i) if char == "\x1b" else None
        if match:
            argument, command = match.groups()
            if command == "A":
                row = max(0, row - int(argument or 1))
            elif command == "K":
                if argument == "2":
                    lines[row] = []
                else:
                    del lines[row][col:]
            i = match.end()
            continue
        if char == "\r":
            col = 0
        elif char == "\n":
            row += 1
            col = 0
            if row == len(lines):
                lines.append([])
        elif char >= " ":
            line = lines[row]
            line.extend(" " * (col - len(line)))
            if col < len(line):
                line[col] = char
            else:
                line.append(char)
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def run_in_pty(args: list[str], cwd: Path, columns: int = 120, python_code: str | None = None) -> str:
    env = {key: value for key, value in os.environ.items() if key not in TOKEN_VARIABLES}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")])),
        HF_HOME=str(cwd / "hf_home"),
        COLUMNS=str(columns),
        LINES="50",
        TERM="xterm-256color",
    )
    env.pop("NO_COLOR", None)
    env.pop("TERM_PROGRAM", None)
    main, child = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-c", python_code] if python_code else [sys.executable, "-m", "speedtronic", *args],
        stdin=child,
        stdout=child,
        stderr=child,
        cwd=cwd,
        env=env,
        close_fds=True,
    )
    os.close(child)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([main], [], [], 120)
            if not ready:
                raise AssertionError("no output from the run for 120 s")
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed the pty
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(main)
        returncode = process.wait(timeout=120)
    text = b"".join(chunks).decode("utf-8", errors="replace")
    assert returncode == 0, text
    return text


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")
def test_on_a_terminal_no_log_line_shares_a_line_with_the_bar(tmp_path: Path) -> None:
    lines = screen(run_in_pty(RUN, tmp_path))
    bar_lines = [line for line in lines if "━" in line]
    assert bar_lines, "\n".join(lines)
    for line in bar_lines:
        assert line.startswith("train "), f"something printed before the bar on its line: {line!r}"
        for word in ("INFO", "WARNING", "eval step", "checkpoint step", "finished at"):
            assert word not in line, f"a log line glued onto the bar: {line!r}"
    assert "12/12" in bar_lines[-1], bar_lines[-1]  # the bar ends at the real total
    text = "\n".join(lines)
    for event in ("eval step 6", "checkpoint step 4", "checkpoint step 8", "eval step 12"):
        assert sum(event in line for line in lines) == 1, f"{event!r} not shown exactly once:\n{text}"
    assert "finished at step 12" in text and "metrics runs/smoke/metrics.jsonl" in text


# A hook that logs on every logging step while the bar is live, as DiLoCo's sync does.
NOISY_RUN = """
import logging
from speedtronic import Trainer, load_config
from speedtronic.engine.logs import setup_logging

setup_logging("info")

class Noisy:
    def on_step(self, payload):
        logging.getLogger("speedtronic.sync").warning("sync note at step %d", payload["step"])

config = load_config("smoke", ["run.log_every=2", "checkpoint.enabled=false"])
Trainer(config, hooks={"noisy": Noisy()}).train(max_steps=10)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pty")
def test_records_logged_mid_run_print_above_the_bar(tmp_path: Path) -> None:
    lines = screen(run_in_pty([], tmp_path, python_code=NOISY_RUN))
    bar_lines = [line for line in lines if "━" in line]
    assert bar_lines, "\n".join(lines)
    for line in bar_lines:
        assert line.startswith("train ") and "sync note" not in line, f"glued onto the bar: {line!r}"
    notes = [line for line in lines if "sync note" in line]
    # Step 1 is a logging step too (issue 26: the first log line comes at step 1, not at log_every).
    assert [line.split("sync note at step ")[1] for line in notes] == ["1", "2", "4", "6", "8", "10"], notes
    assert all(line.startswith("WARNING") for line in notes), notes
    assert "10/10" in bar_lines[-1], bar_lines[-1]


TIMESTAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) speedtronic[\w.]*: \S")


def test_with_stderr_in_a_file_each_event_is_one_timestamped_line(run_cli, tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    result = run_cli(*RUN, "--json", env={"COLUMNS": "40"}, stderr_file=log)
    assert result.returncode == 0, log.read_text(encoding="utf-8")
    lines = log.read_text(encoding="utf-8").splitlines()
    assert lines, "nothing logged"
    for line in lines:
        assert TIMESTAMPED.match(line), f"not one timestamped event per line: {line!r}"
        assert "\x1b" not in line and "━" not in line
    # One line per event, each whole although far wider than the 40-column COLUMNS.
    assert [line.split(": ", 1)[1] for line in lines if "step " in line and " · loss " in line] == [
        line.split(": ", 1)[1] for line in lines if re.search(r"step (1|4|8|12)/12 · loss", line)
    ]
    assert sum("step 1/12 · loss" in line for line in lines) == 1  # the first line comes at step 1 (issue 26)
    assert sum("step 4/12 · loss" in line for line in lines) == 1
    assert sum("eval step 6:" in line for line in lines) == 1
    assert sum("checkpoint step 8 →" in line for line in lines) == 1
    summary = [line for line in lines if "metrics runs/smoke/metrics.jsonl" in line]
    assert len(summary) == 1 and "checkpoint runs/smoke/checkpoints/step_00000012.pt" in summary[0]
    assert any("train loss" in line and "best val loss" in line for line in lines)
    assert any(re.search(r"time [\d.]+s \(.*train [\d.]+s", line) for line in lines)
    assert any("peak memory" in line for line in lines)
    result_json = json.loads(result.stdout.splitlines()[-1])
    assert set(result_json["time_split"]) == {"compile", "train", "eval", "checkpoint"}
    assert result_json["metrics_path"] == "runs/smoke/metrics.jsonl"
    assert result_json["best_val_loss"] <= result_json["val_loss"]


def test_the_logged_loss_is_the_mean_over_the_logging_interval(run_cli, tmp_path: Path) -> None:
    every_step = run_cli(*RUN, "--set", "run.log_every=1", "--set", "run.name=a", "--json")
    by_four = run_cli(*RUN, "--set", "run.name=b", "--json")
    assert every_step.returncode == 0 and by_four.returncode == 0, every_step.stderr + by_four.stderr

    def losses(name: str) -> dict[int, float]:
        events = (json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").open())
        return {e["step"]: e["loss"] for e in events if e["event"] == "step"}

    single, interval = losses("a"), losses("b")
    # Step 1 is logged too (issue 26: a first line at step 1), so the first interval is steps 2…4.
    assert sorted(interval) == [1, 4, 8, 12]
    assert interval[1] == pytest.approx(single[1], rel=1e-6)
    for start, end in ((2, 4), (5, 8), (9, 12)):
        mean = sum(single[s] for s in range(start, end + 1)) / (end - start + 1)
        assert interval[end] == pytest.approx(mean, rel=1e-5)
        assert interval[end] != pytest.approx(single[end], rel=1e-6)


def test_the_bar_says_compiling_until_the_first_step_and_ends_at_the_real_step() -> None:
    import io

    from rich.console import Console

    from speedtronic.engine.progress import ProgressReporter

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    reporter = ProgressReporter(600, console=console)
    reporter.on_train_start({"step": 0, "compiling": True})
    assert reporter.bar is not None
    renderable = reporter.bar.get_renderable()
    rendered = io.StringIO()
    Console(file=rendered, width=120, color_system=None).print(renderable)
    assert "compiling…" in rendered.getvalue() and "0/600" in rendered.getvalue()
    reporter.on_step_end({"step": 1})
    assert reporter.status == ""
    reporter.on_step_end({"step": 40})
    task = reporter.bar.tasks[0]
    assert task.completed == 40
    reporter.on_train_end({"steps": 40, "tokens": 1, "interrupted": True})
    assert (task.total, task.completed) == (40, 40)  # no 600-step ETA left on screen
    assert "40/40" in out.getvalue()
