"""DiLoCo end to end over the S3 bus: a master and two workers as real `speedtronic` processes on
`s3://BUCKET/run` against a loopback moto S3 server, the master SIGKILLed mid-run and restarted, and
every delta a worker uploaded applied exactly once. Also: the CLI without boto3 installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the S3 bus tests need boto3 (pip install -e '.[dev]')")
pytest.importorskip("flask", reason="the S3 bus tests need moto[server] (pip install -e '.[dev]')")

from conftest import SRC_DIR, TOKEN_VARIABLES
from s3_server import ACCESS_KEY, SECRET_KEY, S3Server
from speedtronic.diloco.master.state import KEEP_GLOBALS
from swarm_harness import DELTA_RE, TEXT, Swarm, assert_exactly_once, wait_until, write_config
from test_diloco_multiprocess import assert_loss_went_down


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

    def outer_step() -> int:
        head = read_head()
        return int(head["outer_step"]) if head else -1

    def read_head() -> dict | None:
        try:
            return json.loads(admin.get_object(Bucket=bucket, Key="run/head.json")["Body"].read())
        except Exception:  # not published yet
            return None

    def list_ids() -> set[str]:
        listed = admin.list_objects_v2(Bucket=bucket, Prefix="run/deltas/").get("Contents", [])
        keys = [o["Key"].split("/")[-2:] for o in listed]
        return {f"{node}/{name}" for node, name in keys if DELTA_RE.match(name)}

    # The watcher lists the bucket every 0.2 s: deltas the master processes faster may slip by it
    # (the report says so; the summaries and the master's state are what exactly-once rests on).
    swarm = Swarm(
        tmp_path,
        "other",
        repo=repo,
        list_ids=list_ids,
        read_head=read_head,
        env=aws_env(tmp_path, s3),
        watch_every=0.2,
    )
    try:
        master = swarm.master(cfg)
        swarm.worker(cfg, "w1")
        # w2 names the endpoint on the command line (the others take AWS_ENDPOINT_URL).
        swarm.worker(cfg, "w2", "--endpoint", s3.url)
        wait_until(lambda: outer_step() >= 1, timeout=600, what="the first outer step on S3")
        swarm.kill(master)
        killed_at = outer_step()
        master = swarm.restart(master)
        report = swarm.report(master, timeout=900)
    finally:
        swarm.close()
    print("\n" + report.table())
    rm = report.master
    assert killed_at < 4 <= rm["outer_step"] <= len(rm["applied"]), (killed_at, rm["outer_step"])
    assert "resumed state at outer step" in swarm.log(master), swarm.log(master)[-3000:]
    # At least 4 deltas from each of the 3 nodes; the restarted master's own node may add one (it
    # resumes training from its last checkpoint and numbers on past what it had sent), as on a
    # directory bus. What must hold whatever the timing is exactly-once.
    assert rm["worker"]["node"] == "master"
    assert_exactly_once(report, allow_left=False)
    assert rm["rejected"] == [], rm["rejected"]
    nodes = report.nodes()
    assert nodes["w1"]["applied"] == nodes["w2"]["applied"] == 4 <= nodes["master"]["applied"], report.table()
    assert_loss_went_down(rm)
    listed = admin.list_objects_v2(Bucket=bucket, Prefix="run/deltas/").get("Contents", [])
    assert [o["Key"] for o in listed if o["Key"].endswith(".safetensors")] == []  # processed: deleted
    globals_left = admin.list_objects_v2(Bucket=bucket, Prefix="run/global/").get("Contents", [])
    # The newest KEEP_GLOBALS (+ a killed master's last one, which the restarted master never prunes).
    assert 1 <= len(globals_left) <= KEEP_GLOBALS + 1, [o["Key"] for o in globals_left]
    for life in swarm.lives:
        assert SECRET_KEY not in swarm.log(life) and SECRET_KEY not in (tmp_path / f"{life}.out").read_text()
