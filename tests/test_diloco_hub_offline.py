"""HF_HUB_OFFLINE=1 is a choice, not a network failure: a DiLoCo node on the Hub says so in one line
and exits 2 at its first request, instead of retrying it with back-off as if the Hub were down."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from swarm_harness import text_path, write_config


def test_a_worker_on_the_hub_with_hf_hub_offline_fails_at_once(run_cli: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, text_path(), retry_initial=30.0, retry_max=60.0)  # a retry would show
    env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_TOKEN": "hf_" + "x" * 30}
    done = run_cli("worker", cfg, "--repo", "owner/run", "--node-id", "w1", "--json", env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "HF_HUB_OFFLINE is set" in errors[0], done.stderr[-3000:]
    assert "retrying" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["exit_code"] == 2
