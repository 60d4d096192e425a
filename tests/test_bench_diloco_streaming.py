"""bench/diloco.py's streaming arms (f), run as a user runs them: several P/τ/layout arms in one
invocation (--streaming), each printing its peak upload against the whole model's, and a bad arm
spec refused naming the flag. A tiny run (24 steps of 2 workers) on the always-present pystdlib
corpus; the losses are not asserted, only that every arm ran and what it uploaded."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    common = ["--corpus", "pystdlib", "--steps", "24", "--inner-steps", "12", "--workers", "2", "--no-muon"]
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "diloco.py"), *common, "--sweep", "", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_several_streaming_arms_run_in_one_invocation(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    arms = "2/1,2/1/elements,2/1/elements/lr0.5/mu0.6"
    run = bench("--skip-defaults", "--known", "3.0", "2.0", "--streaming", arms, "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    less = {}
    for key in (
        "streaming P=2 tau=1",
        "streaming P=2 tau=1 elements",
        "streaming P=2 tau=1 elements lr0.5 mu0.6",
    ):
        line = next((x for x in run.stdout.splitlines() if x.strip().startswith(key + ":")), None)
        assert line is not None, run.stdout
        found = re.search(r"\(([\d.]+)x less\), (\d+) syncs", line)
        assert found is not None, line
        less[key] = float(found[1])
        assert int(found[2]) == 4, line  # 24 steps, each of 2 fragments every 12: 4 syncs
    assert all(1.8 <= ratio <= 2.0 for ratio in less.values()), less  # half the model, headers aside
    labels = [row[0] for row in json.loads(out.read_text())["results"][0]["rows"]]
    assert "(f) streaming P=2 tau=1" in labels and "(f) streaming P=2 tau=1 elements" in labels, labels
    assert "(f) streaming P=2 tau=1 elements lr0.5 mu0.6" in labels, labels


def test_a_bad_streaming_arm_is_refused_naming_the_flag() -> None:
    run = bench("--skip-defaults", "--known", "3.0", "2.0", "--streaming", "2/one")
    assert run.returncode != 0 and "--streaming: '2/one' is not P/tau" in run.stderr, run.stderr[-2000:]
    run = bench("--skip-defaults", "--known", "3.0", "2.0", "--streaming", "2/1/rows")
    assert run.returncode != 0 and "'rows' in '2/1/rows' is not layers" in run.stderr, run.stderr[-2000:]
