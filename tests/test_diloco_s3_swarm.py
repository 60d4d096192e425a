"""DiLoCo end to end over the S3 bus: a master and two workers as real `speedtronic` processes on
`s3://BUCKET/run` against a loopback moto S3 server, the master SIGKILLed mid-run and restarted, and
every delta a worker uploaded applied exactly once. Also: the CLI without boto3 installed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the S3 bus tests need boto3 (pip install -e '.[dev]')")
pytest.importorskip("flask", reason="the S3 bus tests need moto[server] (pip install -e '.[dev]')")

from conftest import SRC_DIR, TOKEN_VARIABLES
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server
from test_diloco_multiprocess import (
    TEXT,
    Procs,
    assert_exactly_once,
    assert_loss_went_down,
    wait_until,
    write_config,
)


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(log=tmp_path / "moto.log")
    yield server
    server.stop()


def aws_env(tmp_path: Path, server: S3Server) -> dict[str, str]:
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": server.url,
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }


def test_the_cli_without_boto3_says_how_to_install_it(tmp_path: Path, s3: S3Server) -> None:
    """`speedtronic worker … --repo s3://…` where boto3 cannot be imported: exit 2, one line."""
    hidden = tmp_path / "hide" / "boto3"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('boto3 is hidden by this test')\n")
    cfg = write_config(tmp_path, TEXT if TEXT.exists() else None)
    child = {k: v for k, v in os.environ.items() if k not in TOKEN_VARIABLES}
    child.update(aws_env(tmp_path, s3), PYTHONPATH=os.pathsep.join([str(tmp_path / "hide"), str(SRC_DIR)]))
    args = ["worker", str(cfg), "--repo", "s3://bkt/run", "--node-id", "w1"]
    done = subprocess.run(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=tmp_path,
        env=child,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and 'pip install "speedtronic-lm[s3]"' in lines[0], done.stderr


@pytest.mark.slow
def test_master_and_two_workers_over_s3_with_the_master_killed(tmp_path: Path, s3: S3Server) -> None:
    """As the directory-bus test: the master trains too (three contributors per round); it is SIGKILLed
    after the first outer step and restarted, and resumes from its saved state and checkpoint."""
    bucket = "diloco-e2e"
    admin = s3.admin()
    admin.create_bucket(Bucket=bucket)
    repo = f"s3://{bucket}/run"
    cfg = write_config(tmp_path, TEXT if TEXT.exists() else None, min_deltas=3, request_timeout=10.0)
    procs = Procs(tmp_path, aws_env(tmp_path, s3))

    def outer_step() -> int:
        try:
            return json.loads(admin.get_object(Bucket=bucket, Key="run/head.json")["Body"].read())[
                "outer_step"
            ]
        except Exception:  # not published yet
            return -1

    try:
        master = procs.start("master", "master", cfg, "--repo", repo, "--json")
        w1 = procs.start("w1", "worker", cfg, "--repo", repo, "--node-id", "w1", "--json")
        # w2 names the endpoint on the command line (the others take AWS_ENDPOINT_URL).
        w2 = procs.start(
            "w2", "worker", cfg, "--repo", repo, "--node-id", "w2", "--endpoint", s3.url, "--json"
        )
        wait_until(lambda: outer_step() >= 1, timeout=600, what="the first outer step on S3")
        master.send_signal(signal.SIGKILL)
        master.wait()
        killed_at = outer_step()
        master = procs.start("master2", "master", cfg, "--repo", repo, "--json")
        r1, r2 = procs.result("w1", w1, timeout=900), procs.result("w2", w2, timeout=900)
        rm = procs.result("master2", master, timeout=900)
    finally:
        procs.kill_all()
    applied, uploaded = (
        rm["applied"],
        [f"{w['node']}/{n}" for w in (r1, r2, rm["worker"]) for n in w["uploaded"]],
    )
    assert killed_at < 4 <= rm["outer_step"], (killed_at, rm["outer_step"], applied)
    assert "resumed state at outer step" in procs.log("master2"), procs.log("master2")[-3000:]
    # At least 4 deltas from each of the 3 nodes; the restarted master's own node may add one (it
    # resumes training from its last checkpoint and numbers on past what it had sent), as on a
    # directory bus. What must hold whatever the timing is exactly-once, below.
    assert len(applied) >= 12 and rm["worker"]["node"] == "master", (sorted(applied), sorted(uploaded))
    assert_exactly_once(rm, r1, r2, rm["worker"])
    assert_loss_went_down(rm)
    listed = admin.list_objects_v2(Bucket=bucket, Prefix="run/deltas/").get("Contents", [])
    assert [o["Key"] for o in listed if o["Key"].endswith(".safetensors")] == []  # processed: deleted
    globals_left = admin.list_objects_v2(Bucket=bucket, Prefix="run/global/").get("Contents", [])
    assert 1 <= len(globals_left) <= 4, [o["Key"] for o in globals_left]  # the last 3 (+ a killed one's)
    for name in ("master", "master2", "w1", "w2"):
        assert SECRET_KEY not in procs.log(name) and SECRET_KEY not in (tmp_path / f"{name}.out").read_text()
