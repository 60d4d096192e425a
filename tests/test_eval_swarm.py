"""The global model against the nodes': each node's own evaluation rides in its deltas and `hub status`
shows it beside the global model's; `speedtronic eval A B --global BUS` scores the global model and
the workers' checkpoints side by side. A real 2-worker DiLoCo run over a directory bus (CLI
processes), and the untrusted summary a delta carries checked against hostile values."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from speedtronic.diloco import node_eval
from swarm_harness import Swarm, write_config

SRC = Path(__file__).resolve().parents[1] / "src"


# ---------------------------------------------------------------------------- the untrusted summary


def test_a_summary_round_trips_through_delta_metadata() -> None:
    payload = {
        "step": 50,
        "val_loss": 2.5,
        "val_ppl": 12.2,
        "core": 0.25,
        "tasks": {"shakespeare-cloze": {"accuracy": 0.75, "stderr": 0.03, "centred": 0.5}},
    }

    class Coordinator:
        def __init__(self) -> None:
            self.eval_meta: dict[str, str] = {}

        def record_eval(self, meta: dict[str, str]) -> None:
            self.eval_meta = meta

    coordinator = Coordinator()
    node_eval.Recorder(coordinator).on_eval(payload)
    got = node_eval.read(coordinator.eval_meta)
    assert got == {"step": 50, "val_loss": 2.5, "core": 0.25, "tasks": {"shakespeare-cloze": 0.75}}
    # An eval without tasks (val loss only) and one without val data (tasks only) are both kept.
    assert node_eval.valid({"step": 1, "val_loss": 3.0, "tasks": {}})["core"] is None
    assert node_eval.global_summary(4, None, {"core": 0.0, "tasks": {}}) == {
        "step": 4,
        "val_loss": None,
        "core": 0.0,
        "tasks": {},
    }
    assert node_eval.global_summary(None, None, None) is None


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "[1, 2]",
        json.dumps({"step": True, "tasks": {}}),
        json.dumps({"step": -1, "tasks": {}}),
        json.dumps({"step": 1, "tasks": []}),
        json.dumps({"step": 1, "val_loss": float("nan"), "tasks": {}}),
        json.dumps({"step": 1, "core": 7.0, "tasks": {}}),
        json.dumps({"step": 1, "tasks": {"t": 1.5}}),
        json.dumps({"step": 1, "tasks": {"t": "0.5"}}),
        json.dumps({"step": 1, "tasks": {"\x1b[31mred": 0.5}}),
        json.dumps({"step": 1, "tasks": {f"t{i}": 0.5 for i in range(node_eval.MAX_TASKS + 1)}}),
        json.dumps({"step": 1, "tasks": {"t": 0.5}, "pad": "x" * node_eval.MAX_CHARS}),
        "[" * 100_000,
    ],
)
def test_a_hostile_summary_is_dropped(raw: str) -> None:
    assert node_eval.read({"eval": raw}) is None


# ------------------------------------------------------------------------------- a real DiLoCo run


def speedtronic(cwd: Path, *args: object) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(SRC), "COLUMNS": "1000", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a hung CLI fails the test instead of holding CI
    )


@pytest.mark.slow
def test_hub_status_and_eval_compare_the_global_model_with_each_node(tmp_path: Path, swarm: Swarm) -> None:
    from speedtronic.diloco.launch import run_status

    cfg = write_config(tmp_path, None, max_steps=10, master_trains=False)
    raw = yaml.safe_load(cfg.read_text())
    raw["run"].update(eval_every=5, eval_tasks=["shakespeare-cloze"])
    cfg.write_text(yaml.safe_dump(raw))
    master = swarm.master(cfg)
    workers = [swarm.worker(cfg, node) for node in ("w1", "w2")]
    for worker in workers:
        swarm.result(worker)
    swarm.result(master)

    status = run_status(swarm.repo, None)
    glob = status["global_eval"]
    assert glob is not None and glob["step"] == status["outer_step"]
    assert math.isfinite(glob["val_loss"]) and 0.0 <= glob["tasks"]["shakespeare-cloze"] <= 1.0
    assert glob["core"] == pytest.approx((glob["tasks"]["shakespeare-cloze"] - 0.5) / 0.5)
    for c in status["collaborators"]:
        # The node's eval at step 5 rode in its final delta (the step-10 eval comes after it).
        assert c["eval"]["step"] == 5 and set(c["eval"]["tasks"]) == {"shakespeare-cloze"}, c
        assert status["nodes"][c["node"]]["eval"] == c["eval"]
    shown = speedtronic(tmp_path, "hub", "status", swarm.repo)
    assert shown.returncode == 0, shown.stderr
    assert "global model" in shown.stdout and shown.stdout.count("own eval at step 5") == 2

    checkpoints = [p for p in sorted(tmp_path.glob("**/w[12]/checkpoints")) if p.is_dir()]
    assert len(checkpoints) == 2, checkpoints
    args = ["eval", *checkpoints, "--global", swarm.repo, "--task", "shakespeare-cloze", "--json"]
    result = speedtronic(tmp_path, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    rows = {row["label"]: row for row in out["comparison"]}
    assert list(rows) == [str(checkpoints[0]), str(checkpoints[1]), "global"]
    assert [r["step"] for r in out["models"][:2]] == [10, 10]
    # The global model scored from the bus is the one the master scored: same step, same accuracy.
    assert rows["global"]["step"] == glob["step"]
    assert rows["global"]["shakespeare-cloze"] == pytest.approx(glob["tasks"]["shakespeare-cloze"])
    assert rows["global"]["core"] == pytest.approx(glob["core"])
    human = speedtronic(tmp_path, *args[:-1])
    assert human.returncode == 0 and "comparison" in human.stdout and "global model of" in human.stdout
