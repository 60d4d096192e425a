"""A lease claims its own expiry, and anyone with write access to the bus can plant one: a lease read
from the bus lasts at most one ttl (the claimer's lease_s) from when it was last written, whatever it
says, so a planted far-future lease holds a node id (or the master's role) no longer than a real one.
On a directory the write time is the file's ctime (no one can set it ahead), on S3 the object's
LastModified by the store's clock, on the Hub the lease's taken_at (never later than now)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from speedtronic.diloco.bus.base import ClaimHeld
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.bus.hub import _capped_expiry

FAR = 10**9  # ~31 years


def test_a_planted_far_future_lease_on_a_directory_lasts_one_ttl(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "bus"))
    bus.create_run()
    (tmp_path / "bus" / "leases").mkdir(exist_ok=True)
    planted = {
        "name": "w1",
        "holder": "mallory/1/x",
        "expires_at": time.time() + FAR,
        "taken_at": time.time() + FAR,
    }
    (tmp_path / "bus" / "leases" / "w1.json").write_text(json.dumps(planted))
    with pytest.raises(ClaimHeld) as held:
        bus.claim("w1", "me/2/y", 0.5)
    assert 0 < held.value.expires_in <= 0.5, held.value.expires_in  # not 31 years
    # A planted mtime in the future changes nothing: the ctime is the write time.
    os.utime(tmp_path / "bus" / "leases" / "w1.json", (time.time() + FAR, time.time() + FAR))
    time.sleep(0.6)  # one ttl since the file was written
    claim = bus.claim("w1", "me/2/y", 0.5)
    assert claim.holder == "me/2/y"
    # A real holder still holds it for its ttl.
    with pytest.raises(ClaimHeld):
        bus.claim("w1", "other/3/z", 0.5)


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
        server.admin().create_bucket(Bucket="lease")
        from speedtronic.diloco.bus.registry import open_bus

        bus = open_bus("s3://lease/run")
        bus.create_run()
        yield bus, server.admin()
    finally:
        os.environ.clear()
        os.environ.update(old)
        server.stop()


def test_a_planted_week_long_lease_on_s3_lasts_one_ttl(s3_bus: tuple[Any, Any]) -> None:
    bus, admin = s3_bus
    planted = {"name": "w1", "holder": "mallory/1/x", "ttl_s": 7 * 86400.0, "expires_at": time.time() + FAR}
    admin.put_object(Bucket="lease", Key="run/leases/w1.json", Body=json.dumps(planted).encode())
    # The store's LastModified has whole seconds, so the planted lease may have up to a second less
    # than the ttl left when it is read: a ttl of 1 s left it 0-1 s, and under CI's load the claim came
    # after it (no ClaimHeld). At 4 s at least 3 s are left.
    ttl = 4.0
    with pytest.raises(ClaimHeld) as held:
        bus.claim("w1", "me/2/y", ttl)
    assert 0 < held.value.expires_in <= ttl, held.value.expires_in
    time.sleep(held.value.expires_in + 1.0)  # past one ttl by the store's clock
    assert bus.claim("w1", "me/2/y", ttl).holder == "me/2/y"


def test_a_hub_lease_expiry_is_capped_at_one_ttl_from_when_it_was_taken() -> None:
    now = 1_000_000.0
    assert _capped_expiry({"expires_at": now + FAR, "taken_at": now - 5}, now, 60.0) == now + 55
    assert _capped_expiry({"expires_at": now + FAR, "taken_at": now + FAR}, now, 60.0) == now + 60
    assert _capped_expiry({"expires_at": now + 10, "taken_at": now - 5}, now, 60.0) == now + 10  # a real one
    assert _capped_expiry({"expires_at": "junk"}, now, 60.0) == 0.0
    assert _capped_expiry({"expires_at": float("nan")}, now, 60.0) == 0.0
