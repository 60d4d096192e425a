"""`speedtronic train | sample | checkpoint inspect | data prepare` as real subprocesses: JSON output,
resume, signals (SIGTERM → checkpoint + exit 130; SIGKILL leaves a loadable latest checkpoint)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import speedtronic
from speedtronic.engine.checkpoint.files import LATEST_POINTER, list_checkpoints, load_checkpoint

SRC = Path(speedtronic.__file__).resolve().parents[1]

CONFIG = """
run: {name: cli, max_steps: 6, log_every: 2, eval_every: 3}
model: {n_layer: 1, n_head: 2, d_model: 32}
data: {synthetic: true, vocab_size: 256, num_tokens: 20000, block_size: 16, micro_batch_size: 4, val_batches: 2}
checkpoint: {every_steps: 3}
"""


def cli(*args: str, cwd: Path, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("HF_TOKEN", None)
    result = subprocess.run(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def test_train_json_resume_sample_and_inspect(tmp_path: Path, config_file: Path) -> None:
    first = last_json(
        cli("train", str(config_file), "--max-steps", "3", "--json", cwd=tmp_path, check=True).stdout
    )
    assert {"steps", "tokens", "final_loss", "val_loss", "elapsed_s", "tokens_per_s", "checkpoint"} <= set(
        first
    )
    assert first["steps"] == 3 and first["tokens"] == 3 * 4 * 16 and first["resumed_from"] is None
    assert Path(tmp_path, first["checkpoint"]).name == "step_00000003.pt"

    second = last_json(cli("train", str(config_file), "--json", cwd=tmp_path, check=True).stdout)
    assert second["steps"] == 6 and second["resumed_from"].endswith("step_00000003.pt")
    assert second["tokens"] == 6 * 4 * 16

    refused = cli("train", str(config_file), "--no-resume", cwd=tmp_path)
    assert refused.returncode == 2 and "already holds step_00000006.pt" in refused.stderr

    ckdir = tmp_path / "runs" / "cli" / "checkpoints"
    info = last_json(cli("checkpoint", "inspect", str(ckdir), "--json", cwd=tmp_path, check=True).stdout)
    assert info["step"] == 6 and info["tokens_seen"] == 6 * 4 * 16 and info["parameter_count"] > 0
    assert info["optimizer"]["name"] == "adamw" and info["data_position"]

    greedy = [
        last_json(
            cli(
                "sample",
                str(ckdir),
                "--prompt",
                "ab",
                "-n",
                "12",
                "--temperature",
                "0",
                "--json",
                cwd=tmp_path,
                check=True,
            ).stdout
        )["text"]
        for _ in range(2)
    ]
    assert greedy[0] == greedy[1] and len(greedy[0].encode("utf-8", "replace")) > 0


def test_sigterm_saves_checkpoint_and_exits_130(tmp_path: Path, config_file: Path) -> None:
    config_file.write_text(
        CONFIG.replace("max_steps: 6", "max_steps: 100000").replace("log_every: 2", "log_every: 1")
    )
    metrics = tmp_path / "runs" / "cli" / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "train", str(config_file), "--json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    result = last_json(stdout)
    assert result["interrupted"] is True and result["checkpoint"]
    payload = load_checkpoint(tmp_path / "runs" / "cli" / "checkpoints")
    assert payload["step"] == result["steps"] > 0


def pointer_step(ckdir: Path) -> int:
    try:
        return int(re.fullmatch(r"step_(\d+)\.pt", (ckdir / LATEST_POINTER).read_text().strip()).group(1))  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return -1


@pytest.mark.slow
def test_sigkill_leaves_loadable_latest_checkpoint(tmp_path: Path, config_file: Path) -> None:
    # A checkpoint every step, so kills land in the middle of saves as well as of steps.
    config_file.write_text(
        CONFIG.replace("max_steps: 6", "max_steps: 100000").replace("every_steps: 3", "every_steps: 1")
    )
    ckdir = tmp_path / "runs" / "cli" / "checkpoints"
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for round_ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "speedtronic", "train", str(config_file)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 120
            target = (round_ + 1) * 3
            # Wait on the `latest` pointer, not the files: it moves just after a step file appears.
            while pointer_step(ckdir) < target:
                assert proc.poll() is None and time.monotonic() < deadline, "no checkpoints appeared"
                time.sleep(0.02)
            time.sleep(0.05 * round_)  # land at different points of the step/save cycle
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        payload = load_checkpoint(ckdir)
        assert payload["step"] >= target
        for _, path in list_checkpoints(ckdir):
            load_checkpoint(path)  # every visible file is complete
    resumed = cli("train", str(config_file), "--max-steps", str(payload["step"] + 2), "--json", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert last_json(resumed.stdout)["steps"] == payload["step"] + 2


def test_data_prepare_then_train_on_it(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 400)
    prepared = last_json(
        cli(
            "data", "prepare", str(text), "--out", str(tmp_path / "ds"), "--json", cwd=tmp_path, check=True
        ).stdout
    )
    assert prepared["out"] == str(tmp_path / "ds") and (tmp_path / "ds" / "meta.json").exists()
    config = tmp_path / "ds.yaml"
    config.write_text(
        f"run: {{name: ds, max_steps: 4}}\nmodel: {{n_layer: 1, n_head: 2, d_model: 32}}\n"
        f"data: {{dataset: {tmp_path / 'ds'}, block_size: 16, micro_batch_size: 4}}\n"
    )
    result = last_json(cli("train", str(config), "--json", cwd=tmp_path, check=True).stdout)
    assert result["steps"] == 4 and result["val_loss"] is not None


def test_train_errors_exit_2_without_traceback(tmp_path: Path, config_file: Path) -> None:
    bad = cli("train", str(config_file), "--set", "model.name=transformr", cwd=tmp_path)
    assert bad.returncode == 2
    assert "did you mean 'transformer'" in bad.stderr and "Traceback" not in bad.stderr
    missing = cli("sample", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert (
        missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    )
