"""Inputs that used to escape their bounds (issue 26's held-out probes): each is now one error line
naming the field or file, exit code 2, and nothing read without limit or followed out of its place."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from speedtronic.engine.checkpoint.files import (
    latest_checkpoint,
    list_checkpoints,
    load_file,
    save_checkpoint,
)
from speedtronic.errors import CheckpointError


def _error(result) -> dict:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr  # one line, no traceback
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("settings", "field", "words"),
    [
        (["run.seed=1180591620717411303424"], "run.seed", "less than or equal to 4294967295"),  # 2**70
        (["run.name=../x"], "run.name", "pattern"),
        (["model.n_layer=true"], "model.n_layer", "expected a number, got true"),
        (["data.text_path=/nope.txt"], "data.text_path", "not found"),
    ],
)
def test_validate_refuses_out_of_bounds_settings(run_cli, settings, field, words) -> None:
    args = [arg for s in settings for arg in ("--set", s)]
    out = _error(run_cli("validate", "shakespeare", *args, "--json"))
    assert out["field"] == field and words in out["error"], out


def test_a_special_file_as_text_path_is_named_not_read(run_cli, tmp_path: Path) -> None:
    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)  # opening it for reading would block forever: it must never be opened
    for path in (fifo, Path("/dev/zero")):
        out = _error(run_cli("validate", "shakespeare", "--set", f"data.text_path={path}", "--json"))
        assert out["field"] == "data.text_path" and "not a regular file" in out["error"], out


@pytest.mark.parametrize("name", ["/dev/zero", "fifo", "dir"])
def test_a_config_path_that_is_not_a_regular_file_is_refused_at_once(run_cli, tmp_path: Path, name) -> None:
    if name == "fifo":
        os.mkfifo(tmp_path / "c.yaml")
        path = tmp_path / "c.yaml"
    elif name == "dir":
        path = tmp_path
    else:
        path = Path(name)
    out = _error(run_cli("validate", path, "--json"))
    assert str(path) in out["error"] and ("not a regular file" in out["error"] or "directory" in out["error"])


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("run:\n  max_steps: 5\noptimizer:\n  lr: 0.1\n  lr: 0.2\n", 5, "'lr'"),
        ("run: {max_steps: 5}\nrun: {seed: 3}\n", 2, "'run'"),
    ],
)
def test_duplicate_yaml_keys_are_refused_naming_the_line(run_cli, tmp_path: Path, text, line, key) -> None:
    config = tmp_path / "dup.yaml"
    config.write_text(text)
    out = _error(run_cli("validate", config, "--json"))
    assert f"dup.yaml:{line}:" in out["error"] and f"duplicate key {key}" in out["error"], out


def test_yaml_merge_keys_may_still_be_overridden() -> None:
    from speedtronic.config.strict_yaml import parse_yaml

    text = "x-base: &b {max_steps: 5, seed: 1}\nrun:\n  <<: *b\n  seed: 2\n"
    assert parse_yaml(text, "merge.yaml")["run"] == {"max_steps": 5, "seed": 2}


def test_an_invalid_repo_is_a_usage_error(run_cli) -> None:
    out = _error(run_cli("worker", "smoke", "--repo", "bad repo!!", "--json"))
    assert "owner/name" in out["error"], out


# ------------------------------------------------------------------------------------- checkpoints


def test_a_symlinked_step_file_is_not_a_checkpoint(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    real = save_checkpoint(elsewhere, 5, {"w": torch.zeros(1)})
    run = tmp_path / "run"
    save_checkpoint(run, 3, {"w": torch.zeros(1)})
    (run / "step_00000009.pt").symlink_to(real)
    assert [s for s, _ in list_checkpoints(run)] == [3]
    (run / "latest").write_text("step_00000009.pt\n")  # a pointer to the link is not followed either
    assert latest_checkpoint(run) == run / "step_00000003.pt"


def test_a_step_file_renamed_to_another_step_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 4, {"w": torch.zeros(1)})
    renamed = tmp_path / "step_00000040.pt"
    path.rename(renamed)
    with pytest.raises(CheckpointError, match="named for step 40 but holds step 4"):
        load_file(renamed)


def test_junk_step_files_neither_count_toward_keep_last_nor_win_without_latest(tmp_path: Path) -> None:
    junk = tmp_path / "step_99999999.pt"
    tmp_path.mkdir(exist_ok=True)
    junk.write_bytes(b"not a checkpoint")
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"w": torch.zeros(1)}, keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 3, 99999999]  # the run's own two kept
    assert junk.read_bytes() == b"not a checkpoint"  # and the junk is not the run's to delete
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000003.pt"


def test_an_out_of_range_data_position_is_refused() -> None:
    from speedtronic.engine.data import TokenArray, TrainLoader

    def loader() -> TrainLoader:
        return TrainLoader(TokenArray(torch.arange(2000) % 256), block_size=16, micro_batch_size=4, seed=1)

    state = loader().state_dict()
    for bad in (2**63, -1):
        with pytest.raises(CheckpointError, match="data position batches_served"):
            loader().load_state_dict({**state, "batches_served": bad})


# ------------------------------------------------------------------------------------ run directory


def test_two_runs_on_one_output_directory_are_refused(run_cli, tmp_path: Path) -> None:
    import subprocess
    import sys

    from conftest import SRC_DIR

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from speedtronic import run_lock; "
            f"run_lock.acquire({str(out)!r}); print('held', flush=True); time.sleep(120)",
        ],
        env={**os.environ, "PYTHONPATH": str(SRC_DIR)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = run_cli("train", "smoke", "--set", f"run.output_dir={out}", "--json")
        error = _error(result)
        assert f"pid {holder.pid}" in error["error"] and "run.output_dir" in error["error"], error
        assert not (out / "checkpoints").exists()  # refused before writing anything
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the lock with the killed process: the same run now starts.
    done = run_cli("train", "smoke", "--set", f"run.output_dir={out}", "--set", "run.max_steps=2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_lock_is_reentrant_in_one_process(tmp_path: Path) -> None:
    from speedtronic import run_lock

    first = run_lock.acquire(tmp_path / "r")
    second = run_lock.acquire(tmp_path / "r")
    run_lock.release(second)
    run_lock.release(first)
    again = run_lock.acquire(tmp_path / "r")  # released for good: taken again
    run_lock.release(again)


def test_an_empty_node_id_is_refused_not_replaced_by_the_host_name(run_cli, tmp_path: Path) -> None:
    out = _error(
        run_cli("worker", "smoke", "--repo", f"file://{tmp_path / 'bus'}", "--node-id", "", "--json")
    )
    assert out["error"].startswith("--node-id: empty"), out
    assert not (tmp_path / "bus").exists()
