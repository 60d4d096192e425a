"""SIGTERM to a DiLoCo master and a worker whose S3 bus refuses connections: both exit 130 with
"interrupted" within seconds, not after minutes of back-off (speedtronic/retry.py watches the signal,
speedtronic/interrupts.py). The back-off is set long (5 s doubling to 60 s, 8 attempts: minutes per
request) so that only giving up on the signal can end the processes within the generous bound below."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the S3 bus tests need boto3 (pip install -e '.[dev]')")
pytest.importorskip("flask", reason="the S3 bus tests need moto[server] (pip install -e '.[dev]')")

from s3_server import S3Server
from swarm_harness import Swarm, text_path, write_config
from test_diloco_s3_swarm import aws_env


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    server = S3Server(log=tmp_path / "moto.log")
    yield server
    server.stop()


@pytest.mark.slow
def test_sigterm_with_the_s3_endpoint_refusing_connections_exits_in_seconds(
    tmp_path: Path, s3: S3Server
) -> None:
    admin = s3.admin()
    admin.create_bucket(Bucket="stop")
    cfg = write_config(
        tmp_path, text_path(), max_steps=100000, retry_initial=5.0, retry_max=60.0, retry_attempts=8
    )
    swarm = Swarm(
        tmp_path,
        "other",
        repo="s3://stop/run",
        env=aws_env(tmp_path, s3),
        list_ids=set,  # this test counts no deltas
        read_head=lambda: None,
    )
    try:
        master = swarm.master(cfg, "--no-train")
        worker = swarm.worker(cfg, "w1")
        swarm.wait_log(worker, r"step \d+/\d+ ·", timeout=300)  # training
        s3.stop()  # the port now refuses connections
        for life in (master, worker):
            swarm.wait_log(life, r"retrying in", timeout=120)
        for life in (master, worker):
            life.proc.send_signal(signal.SIGTERM)
        for life in (master, worker):
            try:
                code = life.proc.wait(timeout=60)  # without the fix: minutes of back-off per request
            except subprocess.TimeoutExpired:
                pytest.fail(f"{life.name} still running 60 s after SIGTERM:\n{swarm.log(life)[-3000:]}")
            log = swarm.log(life)
            assert code == 130, (life.name, code, log[-3000:])
            assert "interrupted" in log and "Traceback" not in log, log[-3000:]
    finally:
        swarm.close()


@pytest.fixture
def stopping() -> Iterator[None]:
    from speedtronic import interrupts

    interrupts.note("SIGTERM")  # as a signal handler (or a training loop's graceful stop) does
    try:
        yield
    finally:
        interrupts._stopping.clear()


@pytest.mark.usefixtures("stopping")
def test_once_stopping_a_transient_failure_is_not_retried_and_a_spent_budget_not_waited_for() -> None:
    from speedtronic.errors import TransientBusError
    from speedtronic.hub_client import TokenBucket
    from speedtronic.retry import RetryPolicy

    tries = []

    def down() -> None:
        tries.append(1)
        raise TransientBusError("the bus is down")

    with pytest.raises(TransientBusError, match="not retried: the process is stopping"):
        RetryPolicy(initial=3600.0, max_delay=3600.0, attempts=8).call("read", down)
    assert len(tries) == 1
    bucket = TokenBucket(1, 3600.0, "commits")
    bucket.take()  # the budget's one token
    with pytest.raises(TransientBusError, match="not waited for: the process is stopping"):
        bucket.take()  # the next is an hour away
