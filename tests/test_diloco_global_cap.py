"""The global that head.json names is read no larger than the run's model can be (its manifest specs,
in fp32, with slack for headers): a planted 3 GB file is one clear line for `eval --global` and for a
joining worker, never a MemoryError traceback. The file is sparse (3 GB on paper, nothing on disk),
and each bus checks its size before reading its bytes."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from speedtronic.diloco.bus.base import GlobalTooLarge, Head
from speedtronic.diloco.bus.directory import DirectoryBus
from swarm_harness import text_path, write_config

HUGE = 3 << 30  # 3 GB


def init_run(run_cli: Any, tmp_path: Path) -> tuple[Path, Path]:
    cfg = write_config(tmp_path, text_path())
    bus = tmp_path / "bus"
    done = run_cli("hub", "init", f"file://{bus}", "--config", cfg, "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    return cfg, bus


def plant_huge_global(bus: Path) -> str:
    """A 3 GB global/outer_00000001.safetensors (sparse) and a head.json that names it."""
    name = "global/outer_00000001.safetensors"
    with open(bus / name, "wb") as planted:
        planted.truncate(HUGE)
    head = json.loads((bus / "head.json").read_text())
    head.update(outer_step=1, **{"global": name})
    (bus / "head.json").write_text(json.dumps(head))
    return name


def test_a_huge_global_is_refused_by_size_before_reading_on_a_directory(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "bus"))
    bus.create_run()
    bus.publish(b"g0", {"outer_step": 0})
    plant_huge_global(tmp_path / "bus")
    head = bus.read_head()
    assert head is not None
    with pytest.raises(GlobalTooLarge, match=r"3,221,225,472 bytes, more than this run's model can be"):
        bus.read_global_capped(head, 10_000)
    assert bus.read_global_capped(Head({**head, "global": "global/outer_00000000.safetensors"}), 2) == b"g0"


@pytest.fixture
def s3_bus(tmp_path: Path) -> Iterator[Any]:
    pytest.importorskip("boto3")
    pytest.importorskip("flask")
    from s3_server import S3Server
    from test_diloco_s3_swarm import aws_env

    server = S3Server(log=tmp_path / "moto.log")
    old = dict(os.environ)
    os.environ.update(aws_env(tmp_path, server))
    try:
        server.admin().create_bucket(Bucket="cap")
        from speedtronic.diloco.bus.registry import open_bus

        yield open_bus("s3://cap/run")
    finally:
        os.environ.clear()
        os.environ.update(old)
        server.stop()


def test_a_global_over_the_cap_is_refused_on_s3(s3_bus: Any) -> None:
    s3_bus.create_run()
    head = s3_bus.publish(b"x" * 5000, {"outer_step": 0})
    with pytest.raises(GlobalTooLarge, match=r"more than this run's model can be \(4,999 bytes"):
        s3_bus.read_global_capped(head, 4999)
    assert s3_bus.read_global_capped(head, 5000) == b"x" * 5000


def test_eval_global_refuses_a_huge_global_in_one_line(run_cli: Any, tmp_path: Path) -> None:
    cfg, bus = init_run(run_cli, tmp_path)
    plant_huge_global(bus)
    code = (
        "from speedtronic.config import load_config\n"
        "from speedtronic.diloco.launch import build_reference\n"
        "from speedtronic.eval_compare import install_global\n"
        "from speedtronic.errors import ConfigError\n"
        f"model = build_reference(load_config({str(cfg)!r}, [])).model\n"
        "try:\n"
        f"    install_global(model, {f'file://{bus}'!r})\n"
        "except ConfigError as error:\n"
        "    print('REFUSED', error)\n"
    )
    done = run_cli(python_code=code)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("REFUSED --global file://") and "3,221,225,472 bytes" in line, line
    assert "MemoryError" not in done.stdout + done.stderr


@pytest.mark.slow
def test_a_joining_worker_refuses_a_huge_global_in_one_line(run_cli: Any, tmp_path: Path) -> None:
    cfg, bus = init_run(run_cli, tmp_path)
    plant_huge_global(bus)
    done = run_cli("worker", cfg, "--repo", f"file://{bus}", "--node-id", "w1", "--json")
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert "more than this run's model can be" in lines[0] and "Traceback" not in done.stderr, lines
    assert json.loads(done.stdout.strip().splitlines()[-1])["exit_code"] == 1


@pytest.mark.usefixtures("isolated_env")
def test_a_global_over_the_cap_is_refused_on_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    from hub_server import HubServer
    from test_diloco_hub_bus import OWNER, make_run

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    server.state.add_user("owner", OWNER)
    server.state.add_user("alice", "hf_alicebusunit0002")
    try:
        bus = make_run(server)
        head = bus.publish(b"y" * 5000, {"outer_step": 0})
        with pytest.raises(GlobalTooLarge, match=r"is 5,000 bytes, more than this run's model can be"):
            bus.read_global_capped(head, 4999)
        assert bus.read_global_capped(head, 5000) == b"y" * 5000
    finally:
        server.stop()
