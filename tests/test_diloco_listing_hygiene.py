"""What a bus listing logs about the files it leaves out: never a raw control character from a file
name (an ESC byte would drive the operator's terminal, a newline would forge a log line), and each
left-out file once, not at every poll (a delta file without read permission was warned about 455
times in 66 s). An unreadable delta is not listed until its permissions are fixed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from speedtronic.diloco.bus.base import shown_name
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.bus.hub import HubBus

ESC_NAME = "w1--00000007\x1b[2J\x1b[31m.safetensors"


def directory_bus(tmp_path: Path) -> tuple[DirectoryBus, Path]:
    bus = DirectoryBus(str(tmp_path / "bus"))
    bus.create_run()
    node = tmp_path / "bus" / "deltas" / "w1"
    node.mkdir(parents=True)
    (node / "w1--00000001.safetensors").write_bytes(b"ok")
    (node / ESC_NAME).write_bytes(b"x")
    (tmp_path / "bus" / "deltas" / "w\x1b2").mkdir()
    return bus, node


def test_control_characters_in_listed_names_never_reach_the_log(tmp_path: Path, caplog) -> None:
    bus, _ = directory_bus(tmp_path)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        for _ in range(20):  # twenty polls
            names = [r.name for r in bus.list_deltas(None)]
    assert names == ["w1--00000001.safetensors"]
    messages = [r.getMessage() for r in caplog.records]
    assert all(c.isprintable() for m in messages for c in m), messages
    assert sum("unprintable name" in m for m in messages) == 2, messages  # each name once: file and folder
    assert any("w1--00000007\\x1b[2J" in m for m in messages), messages  # shown escaped
    assert shown_name("a\nb\x1b") == "a\\nb\\x1b"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file: no permission can be missing")
def test_an_unreadable_delta_is_left_out_and_said_once(tmp_path: Path, caplog) -> None:
    bus, node = directory_bus(tmp_path)
    locked = node / "w1--00000002.safetensors"
    locked.write_bytes(b"secret")
    locked.chmod(0)
    try:
        with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
            for _ in range(50):
                assert locked.name not in [r.name for r in bus.list_deltas(None)]
        said = [r.getMessage() for r in caplog.records if "no read permission" in r.getMessage()]
        assert len(said) == 1 and "w1/w1--00000002.safetensors" in said[0], said
        locked.chmod(0o644)  # fixed: listed again
        assert locked.name in [r.name for r in bus.list_deltas(None)]
    finally:
        locked.chmod(0o644)


def test_the_hub_listing_leaves_out_unprintable_names_said_once(caplog) -> None:
    class Entry:
        def __init__(self, path: str) -> None:
            self.path, self.size, self.blob_id = path, 2, "b"

    bus = HubBus("owner/run", endpoint="http://127.0.0.1:9")  # no request: the listing is faked below
    bus._collaborators = {"w1": {"user": "w1", "delta_repo": "w1/run-deltas"}}
    bus._listed_heads = lambda: {"w1/run-deltas": "sha"}  # type: ignore[method-assign]
    entries = [Entry("deltas/w1/w1--00000001.safetensors"), Entry(f"deltas/w1/{ESC_NAME}")]
    bus._entries = lambda repo, sha: entries  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        for _ in range(5):
            assert [r.name for r in bus.list_deltas(None)] == ["w1--00000001.safetensors"]
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unprintable name" in m for m in messages) == 1, messages
    assert all(c.isprintable() for m in messages for c in m), messages


def test_a_rejection_reason_from_the_head_is_shown_without_control_characters() -> None:
    from speedtronic.diloco.worker.feedback import own_rejections

    name = "w1--00000003.safetensors"
    head = {"rejections": {"w1": {"recent": [[name, "stale\x1b[2J\nFAKE LOG LINE"]]}}}
    seen: dict[str, str] = {}
    assert own_rejections(head, "w1", [name], seen) == [(name, "stale\\x1b[2J\\nFAKE LOG LINE")]
