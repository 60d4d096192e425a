"""The directory bus (`file://PATH`): a local disk or a shared mount, several processes and machines.

Every write goes to a hidden temp file in the destination directory and is renamed into place, so a
reader sees a whole file or none (rename is atomic within one filesystem, NFS included); readers skip
hidden files, and the master removes temp files left by a writer that died mid-write. Global models
are immutable files named by outer step, written before the head that points at them. The
filesystem's permissions are the access control: anyone who can write into deltas/ contributes.
This module never follows a path from the data it reads: node and file names are validated first.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.diloco.bus.base import (
    Bus,
    BusError,
    DeltaRef,
    PermissionDenied,
    TransientBusError,
    dumps,
    loads,
)
from speedtronic.diloco.codec import NODE_RE

KEEP_GLOBALS = 3
STALE_TMP_S = 3600.0


class DirectoryBus(Bus):
    def __init__(self, path: str) -> None:
        if not path:
            raise BusError("file:// needs a path, e.g. file:///shared/run1 or file://runs/bus")
        self.root = Path(path).expanduser()
        self.url = f"file://{self.root}"

    def _path(self, rel: str) -> Path:
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise BusError(f"refusing path {rel!r}")
        return self.root.joinpath(*parts)

    def ensure(self) -> None:
        """Create the directory layout (the master does this on first start)."""
        try:
            (self.root / "global").mkdir(parents=True, exist_ok=True)
            (self.root / "deltas").mkdir(exist_ok=True)
        except OSError as error:
            raise PermissionDenied(f"cannot create the run directory {self.root}: {error.strerror}") from None

    # -- documents ------------------------------------------------------------------------------
    def read_json(self, path: str) -> dict[str, Any] | None:
        try:
            raw = self._path(path).read_bytes()
        except FileNotFoundError:
            return None
        except PermissionError:
            raise PermissionDenied(f"{self.url}: no read permission on {path}") from None
        return loads(raw, f"{self.url}/{path}")

    def write_json(self, path: str, data: dict[str, Any]) -> None:
        self.ensure()
        atomic_write_bytes(self._path(path), dumps(data))

    def read_file(self, path: str) -> bytes:
        try:
            return self._path(path).read_bytes()
        except FileNotFoundError:
            raise BusError(f"{self.url}: {path} is missing") from None

    def publish_global(self, data: bytes, head: dict[str, Any]) -> None:
        self.ensure()
        name = f"global/outer_{int(head['outer_step']):08d}.safetensors"
        atomic_write_bytes(self._path(name), data)
        self.write_json("head.json", {**head, "global": name})
        old = sorted(p for p in (self.root / "global").glob("outer_*.safetensors"))[:-KEEP_GLOBALS]
        for path in old:
            path.unlink(missing_ok=True)

    # -- deltas ---------------------------------------------------------------------------------
    def _node_dir(self, node: str) -> Path:
        if not NODE_RE.match(node):
            raise BusError(f"invalid node id {node!r}")
        return self.root / "deltas" / node

    def put_delta(self, node: str, name: str, data: bytes, *, prune: list[str] = ()) -> None:
        directory = self._node_dir(node)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(directory / name, data)
        except PermissionError:
            raise PermissionDenied(f"{self.url}: missing write permission on {directory}") from None
        except OSError as error:  # disk full, a flaky mount: worth another try later
            raise TransientBusError(f"{self.url}: cannot write {name} ({error.strerror or error})") from None

    def delta_exists(self, node: str, name: str) -> bool:
        try:
            return (self._node_dir(node) / name).is_file()
        except OSError as error:
            raise TransientBusError(f"{self.url}: cannot check {name} ({error})") from None

    def list_own_deltas(self, node: str) -> list[str]:
        directory = self._node_dir(node)
        return (
            sorted(p.name for p in directory.glob("*") if not p.name.startswith("."))
            if directory.exists()
            else []
        )

    def list_deltas(self, collaborators: dict[str, dict[str, Any]] | None) -> list[DeltaRef]:
        refs: list[DeltaRef] = []
        base = self.root / "deltas"
        if not base.exists():
            return refs
        now = time.time()
        for node_dir in sorted(base.iterdir()):
            if node_dir.name.startswith(".") or not node_dir.is_dir():
                continue
            for path in sorted(node_dir.iterdir()):
                if path.name.startswith("."):
                    try:  # a writer that died mid-write leaves its temp file
                        if path.name.endswith(".tmp") and now - path.stat().st_mtime > STALE_TMP_S:
                            path.unlink()
                    except OSError:
                        pass
                    continue
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                refs.append(DeltaRef(node_dir.name, path.name, size, str(node_dir)))
        return refs

    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes:
        path = Path(ref.where) / ref.name
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)  # the decoder rejects anything longer than the limit

    def delete_deltas(self, refs: list[DeltaRef]) -> None:
        for ref in refs:
            (Path(ref.where) / ref.name).unlink(missing_ok=True)

    # -- access ---------------------------------------------------------------------------------
    def check_worker_access(self, node: str) -> None:
        if self.root.exists() and not os.access(self.root, os.R_OK | os.X_OK):
            raise PermissionDenied(f"{self.url}: missing read permission on the run directory")
        directory = self._node_dir(node)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe.{secrets.token_hex(4)}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise PermissionDenied(
                f"{self.url}: missing write permission on {directory} ({error.strerror})"
            ) from None
