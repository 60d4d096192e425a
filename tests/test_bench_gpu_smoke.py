"""The GPU benches run end to end at tiny size on the CPU (`--smoke`), so a lent GPU's few minutes are
never spent on a script that fails before it measures (bench/gpu.py once did: a run name with "+")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_ddp import env

BENCH = Path(__file__).resolve().parents[1] / "bench"


def last_json(script: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gpu_bench_smoke_runs_every_arm() -> None:
    out = last_json("gpu.py")
    assert [r["label"] for r in out["runs"]] == ["adamw", "adamw+ooo", "muon", "adamw-eager"]
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in out["runs"]), out["runs"]
    for ratio in ("ooo_step_time_ratio", "muon_step_time_ratio", "compile_speedup"):
        assert out[ratio] > 0, (ratio, out)


@pytest.mark.slow
def test_fsdp_ddp_bench_smoke_trains_the_same_model_under_both_wraps() -> None:
    out = last_json("fsdp_ddp.py")  # 2 gloo ranks under torchrun
    assert out["ranks"] == 2
    rows = {r["arm"]: r for r in out["runs"]}
    assert sorted(rows) == ["ddp", "fsdp"]
    # Same seed, same batches, fp32 on CPU: the wraps train the same model.
    assert rows["fsdp"]["final_loss"] == pytest.approx(rows["ddp"]["final_loss"], rel=1e-4), rows
    assert out["fsdp_step_time_ratio"] > 0
