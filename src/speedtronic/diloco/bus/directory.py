"""The directory bus (`file://PATH`): a local disk or a shared mount, several processes and machines.

Every write goes to a hidden temp file in the destination directory and is renamed into place, so a
reader sees a whole file or none (rename is atomic within one filesystem, NFS included); readers skip
hidden files, and the master removes temp files left by a writer that died mid-write. Global models
are immutable files named by outer step, written before the head that points at them. The
filesystem's permissions are the access control: anyone who can write into deltas/ contributes.

Everything under deltas/ is hostile until proven otherwise. The master walks it through directory
file descriptors opened with O_NOFOLLOW, so a symlinked node directory or delta file is never
followed, read or deleted through (the link itself is skipped); only regular files are listed and
read (a directory or FIFO named like a delta is skipped; opening with O_NONBLOCK and checking
fstat before reading means a FIFO can never block the outer loop), and reads stop at the size limit.
Deletion unlinks by name relative to the already-verified directory descriptor, so a directory
swapped for a symlink between listing and deleting cannot redirect it outside the bus.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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

logger = logging.getLogger("speedtronic.diloco")
KEEP_GLOBALS = 3
STALE_TMP_S = 3600.0
# Never follow the last path component; never block on a FIFO or a device.
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


@contextmanager
def _open_dir(name: str | Path, dir_fd: int | None = None) -> Iterator[int]:
    """A descriptor of directory `name` (relative to `dir_fd`), refusing symlinks (OSError)."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


class DirectoryBus(Bus):
    def __init__(self, path: str) -> None:
        if not path:
            raise BusError("file:// needs a path, e.g. file:///shared/run1 or file://runs/bus")
        self.root = Path(path).expanduser()
        self.url = f"file://{self.root}"
        self._skipped: set[str] = set()  # odd entries already logged once

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

    def _skip(self, what: str, why: str) -> None:
        if what not in self._skipped:
            self._skipped.add(what)
            logger.warning("DiLoCo bus: skipping deltas/%s (%s); it is never followed or read", what, why)

    def list_deltas(self, collaborators: dict[str, dict[str, Any]] | None) -> list[DeltaRef]:
        refs: list[DeltaRef] = []
        try:
            with _open_dir(self.root / "deltas") as base:
                for node_entry in sorted(os.scandir(base), key=lambda e: e.name):
                    if node_entry.name.startswith("."):
                        continue
                    if node_entry.is_symlink() or not node_entry.is_dir(follow_symlinks=False):
                        self._skip(
                            node_entry.name, "not a directory" if not node_entry.is_symlink() else "a symlink"
                        )
                        continue
                    try:
                        with _open_dir(node_entry.name, base) as node_fd:
                            refs.extend(self._list_node(node_entry.name, node_fd))
                    except OSError as error:  # swapped for a symlink since scandir, or unreadable
                        self._skip(node_entry.name, error.strerror or str(error))
        except FileNotFoundError:
            return refs
        except OSError as error:
            raise TransientBusError(f"{self.url}: cannot list deltas ({error.strerror or error})") from None
        return refs

    def _list_node(self, node: str, node_fd: int) -> list[DeltaRef]:
        refs: list[DeltaRef] = []
        now = time.time()
        for entry in sorted(os.scandir(node_fd), key=lambda e: e.name):
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.startswith("."):
                # A writer that died mid-write leaves its temp file; unlink never follows a link.
                if (
                    entry.name.endswith(".tmp")
                    and stat.S_ISREG(info.st_mode)
                    and now - info.st_mtime > STALE_TMP_S
                ):
                    with suppress(OSError):
                        os.unlink(entry.name, dir_fd=node_fd)
                continue
            if not stat.S_ISREG(info.st_mode):
                kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
                self._skip(f"{node}/{entry.name}", kind)
                continue
            etag = f"{info.st_ino}:{info.st_mtime_ns}:{info.st_size}"
            refs.append(DeltaRef(node, entry.name, info.st_size, str(self.root / "deltas" / node), etag))
        return refs

    @contextmanager
    def _node_fd(self, ref: DeltaRef) -> Iterator[int]:
        """The verified (never symlinked) directory descriptor of `ref`'s node under deltas/."""
        if not NODE_RE.match(ref.node) or "/" in ref.name or ref.name in (".", ".."):
            raise BusError(f"refusing delta reference {ref.id!r}")
        with _open_dir(self.root / "deltas") as base, _open_dir(ref.node, base) as node_fd:
            yield node_fd

    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes:
        """At most max_bytes + 1 bytes of a regular file (the decoder rejects anything longer)."""
        try:
            with self._node_fd(ref) as node_fd:
                fd = os.open(ref.name, _FILE_FLAGS, dir_fd=node_fd)
                try:
                    if not stat.S_ISREG(os.fstat(fd).st_mode):
                        raise BusError(f"{ref.id} is not a regular file")
                    os.set_blocking(fd, True)
                    chunks, left = [], max_bytes + 1
                    while left > 0:
                        chunk = os.read(fd, min(left, 1 << 24))
                        if not chunk:
                            break
                        chunks.append(chunk)
                        left -= len(chunk)
                    return b"".join(chunks)
                finally:
                    os.close(fd)
        except FileNotFoundError:
            raise BusError(f"{ref.id} disappeared") from None
        except OSError as error:  # ELOOP: a symlink swapped in since listing
            raise BusError(f"cannot read {ref.id} ({error.strerror or error})") from None

    def delete_deltas(self, refs: list[DeltaRef]) -> None:
        for ref in refs:
            try:
                with self._node_fd(ref) as node_fd:
                    info = os.stat(ref.name, dir_fd=node_fd, follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode):  # never a directory; a link is not ours to judge
                        os.unlink(ref.name, dir_fd=node_fd)
            except FileNotFoundError:
                continue
            except OSError as error:
                logger.warning("DiLoCo bus: cannot delete %s (%s)", ref.id, error.strerror or error)

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
