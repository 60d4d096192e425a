"""The directory bus on a storage remounted read-only for a while (bench/chaos.py's "bus down" on a
directory): every write fails with EROFS, which is an outage worth retrying (TransientBusError), not a
misconfiguration — opening the run's lock file included, and releasing a lease. Once the mount is
read-write again the same bus object claims, publishes and releases as before.

Needs root (a read-only bind mount of the run directory over itself); skipped elsewhere.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.errors import BusError, PermissionDenied, TransientBusError

HOLDER = "thishost/1/0123456789abcdef"


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[tuple[DirectoryBus, Path]]:
    root = tmp_path / "run"
    bus = DirectoryBus(str(root))
    bus.write_manifest({"format": 1})
    if os.geteuid() != 0 or not _mount("--bind", str(root), str(root)):
        pytest.skip("needs root and mount (a read-only bind mount)")
    try:
        yield bus, root
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def test_a_read_only_run_directory_is_an_outage_not_a_misconfiguration(
    read_only: tuple[DirectoryBus, Path],
) -> None:
    bus, root = read_only
    claim = bus.claim("w1", HOLDER, 30.0)
    assert _mount("-o", "remount,ro,bind", str(root)), "remount read-only"
    with pytest.raises(TransientBusError, match="Read-only file system"):
        bus.claim("w1", HOLDER, 30.0)  # a renewal: the lock file cannot be opened for writing
    with pytest.raises(TransientBusError):
        bus.release(claim)  # retried or left to lapse, never a traceback
    assert _mount("-o", "remount,rw,bind", str(root)), "remount read-write"
    renewed = bus.claim("w1", HOLDER, 30.0)
    assert renewed.expires_at >= claim.expires_at
    bus.release(renewed)
    assert not list((root / "leases").glob("*.json"))


def test_a_lock_file_that_is_a_directory_is_still_refused_as_a_layout_error(tmp_path: Path) -> None:
    root = tmp_path / "run"
    bus = DirectoryBus(str(root))
    bus.write_manifest({"format": 1})
    (root / ".bus.lock").mkdir()
    with pytest.raises(BusError, match="must be a regular file") as refused:
        bus.claim("w1", HOLDER, 30.0)
    assert not isinstance(refused.value, (TransientBusError, PermissionDenied))
