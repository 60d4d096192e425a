"""Data parallel with torch.distributed on CPU (gloo): same loss curve as one process, resume across world sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import speedtronic

SRC = Path(speedtronic.__file__).resolve().parents[1]
CONFIG = """
run: {name: ddp, max_steps: 6, log_every: 1, eval_every: 3, seed: 3}
model: {n_layer: 2, n_head: 2, d_model: 32, dropout: 0.0}
data: {synthetic: true, vocab_size: 64, num_tokens: 40000, block_size: 16, micro_batch_size: 4,
       target_batch_size: 16, val_batches: 4}
optimizer: {name: muon, lr: 3.0e-3}
checkpoint: {every_steps: 3}
logging: {hooks: [jsonl]}
"""


def env() -> dict[str, str]:
    child = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
    child["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    return child


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def train(cwd: Path, *extra: str, ranks: int = 1, launcher: str = "torchrun") -> dict:
    args = ["train", str(cwd / "run.yaml"), "--json", *extra]
    if ranks == 1:
        command = [sys.executable, "-m", "speedtronic", *args]
    elif launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
        ]
        command += ["-m", "speedtronic", *args]
    else:
        command = [sys.executable, "-m", "speedtronic", *args, "--nproc", str(ranks)]
    result = run(command, cwd)
    reports = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, result.stdout  # only rank 0 reports
    return json.loads(reports[0])


def step_losses(cwd: Path) -> dict[int, float]:
    lines = (cwd / "runs" / "ddp" / "metrics.jsonl").read_text().splitlines()
    return {e["step"]: e["loss"] for e in map(json.loads, lines) if e["event"] == "step"}


def make_run(tmp_path: Path, name: str) -> Path:
    cwd = tmp_path / name
    cwd.mkdir()
    (cwd / "run.yaml").write_text(CONFIG)
    return cwd


@pytest.mark.slow
def test_two_ranks_match_one_process_and_resume_on_one(tmp_path: Path) -> None:
    single = make_run(tmp_path, "single")
    one = train(single)

    ddp = make_run(tmp_path, "ddp")
    two = train(ddp, ranks=2)
    assert two["steps"] == one["steps"] == 6 and two["tokens"] == one["tokens"]
    a, b = step_losses(single), step_losses(ddp)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:  # the same global batches; only the order of float sums differs
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-4)
    assert a[6] < a[1]

    # Stop a 2-rank run at step 3 (launched through --nproc), then finish it in one process.
    moved = make_run(tmp_path, "moved")
    half = train(moved, "--max-steps", "3", ranks=2, launcher="nproc")
    assert half["steps"] == 3 and half["checkpoint"]
    rest = train(moved)
    assert rest["resumed_from"] and rest["steps"] == 6
    resumed = step_losses(moved)
    for step in range(4, 7):
        assert resumed[step] == pytest.approx(a[step], rel=1e-4), step
