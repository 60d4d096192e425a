"""A node whose config does not match the run's is a usage error: exit 2, one line naming the field and
the fix. A master restarted with another distributed.sync.inner_steps is refused like a model or
fragment mismatch (the run's rounds, token bounds and end were planned with the manifest's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarm_harness import text_path, write_config


@pytest.fixture
def run(run_cli: Any, tmp_path: Path) -> tuple[Path, str]:
    cfg = write_config(tmp_path, text_path())
    bus = f"file://{tmp_path / 'bus'}"
    done = run_cli("hub", "init", bus, "--config", cfg, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    return cfg, bus


def refused(done: Any) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert "Traceback" not in done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["exit_code"] == 2
    return lines[0]


def test_a_master_with_other_inner_steps_is_refused(run_cli: Any, run: tuple[Path, str]) -> None:
    cfg, bus = run
    done = run_cli("master", cfg, "--repo", bus, "--set", "distributed.sync.inner_steps=7", "--json")
    line = refused(done)
    assert "distributed.sync.inner_steps is 7 here, but the run syncs every 5" in line, line
    assert "set distributed.sync.inner_steps=5" in line, line


def test_a_worker_with_other_fragments_exits_2(run_cli: Any, run: tuple[Path, str]) -> None:
    cfg, bus = run
    args = ["--set", "distributed.sync.fragments=2", "--json"]
    line = refused(run_cli("worker", cfg, "--repo", bus, "--node-id", "w1", *args))
    assert "distributed.sync.fragments is 2 here" in line and "set distributed.sync.fragments=1" in line, line


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m: m["params"].update({k: {"shape": [1], "dtype": "float99"} for k in list(m["params"])[:1]}),
        lambda m: m.update(params=list(m["params"].values())),
        lambda m: m["params"].update(
            {k: {"shape": [2, 3], "dtype": "float32"} for k in list(m["params"])[:1]}
        ),
    ],
    ids=["bad-dtype", "params-as-list", "params-not-the-fingerprint"],
)
def test_a_joining_worker_reads_a_tampered_manifest_as_one_line(
    run_cli: Any, run: tuple[Path, str], tamper: Any
) -> None:
    cfg, bus = run
    path = Path(bus.removeprefix("file://")) / "manifest.json"
    manifest = json.loads(path.read_text())
    tamper(manifest)
    path.write_text(json.dumps(manifest))
    done = run_cli("worker", cfg, "--repo", bus, "--node-id", "w1", "--json")
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert "manifest.json: field " in lines[0] and "Traceback" not in done.stderr, lines


def test_a_worker_syncing_more_often_than_the_run_is_warned_once(run_cli: Any, run: tuple[Path, str]) -> None:
    """A slow node set to sync every H/4 trains (the master stretches its short deltas) but is told they
    were measured to cost; a node at the run's H is not."""
    from speedtronic.diloco.launch import short_sync_warning

    assert short_sync_warning(5, 20) is not None
    assert short_sync_warning(20, 20) is None and short_sync_warning(40, 20) is None
    assert short_sync_warning(5, None) is None  # an old manifest that does not say
    cfg, bus = run
    short = run_cli("worker", cfg, "--repo", bus, "--node-id", "w1", "--max-steps", "1", "--json",
                    "--set", "distributed.sync.inner_steps=1")  # fmt: skip
    assert short.returncode == 0, short.stderr[-3000:]
    said = [line for line in short.stderr.splitlines() if "under the run's 5" in line]
    assert len(said) == 1 and "WARNING" in said[0] and "syncing every 5 of its own steps" in said[0], said
    plain = run_cli("worker", cfg, "--repo", bus, "--node-id", "w2", "--max-steps", "1", "--json")
    assert plain.returncode == 0 and "under the run's" not in plain.stderr, plain.stderr[-3000:]
