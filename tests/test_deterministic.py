"""`run.deterministic: true`: fp32, eager, deterministic algorithms and one thread, on any CPU profile;
and a kill -9 loop — killed at random points, over and over — that still resumes bitwise."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic import hardware
from speedtronic.config import load_config
from speedtronic.engine.checkpoint.files import load_checkpoint
from speedtronic.plan import DataFacts, DeviceFacts, plan_run

CONFIG = """
run: {name: det, max_steps: MAX, log_every: 50, eval_every: 0, deterministic: true}
model: {n_layer: 1, n_head: 2, d_model: 32}
data: {synthetic: true, vocab_size: 64, num_tokens: 20000, block_size: 16, micro_batch_size: 4, val_batches: 1}
optimizer: {name: muon}
checkpoint: {every_steps: 1, keep_last: 2}
logging: {hooks: []}
"""


@pytest.fixture(autouse=True)
def restore_torch_modes() -> Iterator[None]:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_plan_of_a_deterministic_run_is_fp32_and_eager(native: bool, device: str) -> None:
    config = load_config(
        {"run": {"deterministic": True, "max_steps": 5000}, "precision": {"mode": "bf16"}, "compile": True}
    )
    plan = plan_run(config, data=DataFacts(256), device=DeviceFacts(device, native_bf16=native))
    assert plan.deterministic and plan.precision == "fp32" and plan.autocast is None
    assert not plan.compile and plan.compile_reason == "run.deterministic: eager"
    assert any("run.deterministic runs fp32" in w for w in plan.warnings)
    assert plan.as_dict()["deterministic"] is True


def test_validate_json_and_the_start_up_summary_show_it(run_cli: Any, tmp_path: Path) -> None:
    path = tmp_path / "det.yaml"
    path.write_text(CONFIG.replace("MAX", "2"))
    result = run_cli("train", path, "--json", env={hardware.CPU_BF16_ENV: "native"})
    assert result.returncode == 0, result.stderr
    assert "deterministic: fp32, eager, deterministic algorithms, 1 thread" in result.stderr
    import json

    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["plan"]["deterministic"] is True and summary["precision"] == "fp32"


def _train_in_child(config: Path, cwd: Path) -> int:
    """Fork a child (torch already imported: no start-up cost) that runs `speedtronic train CONFIG`."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.chdir(cwd)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            from speedtronic.cli import main

            main(["train", str(config)])
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        finally:
            os._exit(code)
    return pid


def _final_state(checkpoints: Path) -> dict[str, Any]:
    payload = load_checkpoint(checkpoints)
    return {"step": payload["step"], "model": payload["parts"]["model"], "opt": payload["parts"]["optimizer"]}


def _assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child per kill")
def test_kill_9_loop_resumes_bitwise(tmp_path: Path) -> None:
    """≥ 20 SIGKILLs at random points of steps and saves (a checkpoint every step), then a resume to
    the end: the final weights and optimizer state equal an uninterrupted run's, bit for bit."""
    steps = 300
    config = tmp_path / "det.yaml"
    config.write_text(CONFIG.replace("MAX", str(steps)))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    began = time.monotonic()
    assert os.waitpid(_train_in_child(config, straight), 0)[1] == 0
    # Kill within the first 1/25 of a whole run's time, measured here: 20 kills then cover under
    # the whole run on any machine, fast or loaded, so the run never ends before the last kill.
    longest = max(0.05, (time.monotonic() - began) / 25)
    checkpoints = killed / "runs" / "det" / "checkpoints"
    rng = random.Random(13)
    kills, started = 0, time.monotonic()
    while kills < 20:
        assert time.monotonic() - started < 300, f"only {kills} kills in 300 s"
        pid = _train_in_child(config, killed)
        time.sleep(rng.uniform(0.01, longest))
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:  # finished before the kill: too late in the run to count, start over
            pytest.fail(f"the run finished after {kills} kills; lengthen it")
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        kills += 1
    step_before_resume = load_checkpoint(checkpoints)["step"] if (checkpoints / "latest").exists() else 0
    assert step_before_resume < steps
    assert os.waitpid(_train_in_child(config, killed), 0)[1] == 0
    reference = _final_state(straight / "runs" / "det" / "checkpoints")
    resumed = _final_state(checkpoints)
    assert reference["step"] == resumed["step"] == steps
    _assert_bitwise(reference, resumed)
