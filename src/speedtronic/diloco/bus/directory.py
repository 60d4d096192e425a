"""The directory bus (`file://PATH`): a local disk or a shared mount, several processes and machines.

Every write goes to a hidden temp file in the destination directory and is renamed into place, so a
reader sees a whole file or none (rename is atomic within one filesystem, NFS included); readers skip
hidden files, and the master removes temp files left by a writer that died mid-write. Global models
are immutable files named by outer step (`global/outer_<step>.safetensors`, or `outer_<step>.<random>`
where a planted directory holds the name), written before the head that points at them. The
filesystem's permissions are the access control: anyone who can write into deltas/ contributes.

Everything below the run directory is hostile until proven otherwise. The bus walks deltas/, global/
and leases/ through directory file descriptors opened with O_NOFOLLOW, so a symlinked directory or
file is never followed, read, written or deleted through (a link in deltas/ is skipped; a link for
global/ or leases/ raises UnsafeLayout naming it, which stops a master or worker); only regular files
are read (a directory or FIFO named like a delta or a global is skipped or refused; opening with
O_NONBLOCK and checking fstat before reading means a FIFO never blocks a reader), and reads stop at a
size limit. Deletion unlinks by name relative to the already-verified directory descriptor, so a
directory swapped for a symlink between listing and deleting cannot redirect it outside the bus.
global/ is never scanned for deletion: `publish(prune=)` unlinks exactly the regular files the master
names (globals it published itself, master/state.py), so junk such as `outer_99999999.safetensors` is
never touched and never makes the master delete the global the head names; the only files removed
by pattern are the bus's own stale temp files (`.outer_<step>….tmp`).

Conditional publish and leases: `publish(..., expected=)` and `claim`/`release` run under an
exclusive flock on `.bus.lock` in the run directory (NFSv4 and local filesystems honour it between
machines). `publish` compares the stored head.json with `expected` (its version — inode, mtime and
size — or, when that moved, its content) and writes nothing when another master has advanced the
run. A lease is `leases/<name>.json` ({holder, expires_at}); a free name is created with O_EXCL, an
expired or own lease is replaced, a live lease of another holder raises ClaimHeld.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.diloco.bus.base import (
    HEAD,
    MANIFEST,
    Bus,
    BusError,
    Claim,
    ClaimHeld,
    DeltaRef,
    Head,
    HeadMoved,
    PermissionDenied,
    TransientBusError,
    UnsafeLayout,
    dumps,
    loads,
    shown_name,
    too_large,
)
from speedtronic.diloco.codec import NODE_RE

if TYPE_CHECKING:
    from speedtronic.config.distributed import BusConfig

logger = logging.getLogger("speedtronic.diloco")
STALE_TMP_S = 3600.0
MAX_DOC_BYTES = 64 << 20  # manifest, head and lease documents (a manifest lists every parameter)
LOCK_FILE = ".bus.lock"
LOCK_WAIT_S = 60.0
GLOBAL_RE = re.compile(r"^outer_(\d{8,12})(?:\.[0-9a-f]{8})?\.safetensors$")
UPDATE_RE = re.compile(r"^update_(\d{8,12})(?:\.[0-9a-f]{8})?\.safetensors$")  # a global's update
# What _write_at leaves behind in global/ when the writer dies mid-write (removed when stale).
GLOBAL_TMP_RE = re.compile(r"^\.(?:outer|update)_\d{8,12}(?:\.[0-9a-f]{8})?\.safetensors\.[0-9a-f]{8}\.tmp$")
# Never follow the last path component; never block on a FIFO or a device.
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


@contextmanager
def _open_dir(name: str | Path, dir_fd: int | None = None) -> Iterator[int]:
    """A descriptor of directory `name` (relative to `dir_fd`), refusing symlinks (OSError)."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _version(info: os.stat_result) -> str:
    return f"{info.st_ino}:{info.st_mtime_ns}:{info.st_size}"


def _write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write `name` in the verified directory `dir_fd` atomically (temp file, fsync, rename)."""
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, _NEW_FLAGS, 0o666, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    with suppress(OSError):
        os.fsync(dir_fd)


class OverLimit(BusError):
    """A file larger than the reader's limit (`size`: its size when known); never read whole."""

    def __init__(self, message: str, size: int | None) -> None:
        super().__init__(message)
        self.size = size


def _read_fd(fd: int, limit: int) -> bytes:
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class DirectoryBus(Bus):
    scheme = "file"
    supports_updates = True
    creates_on_master_start = True

    def __init__(self, path: str) -> None:
        if not path:
            raise BusError("file:// needs a path, e.g. file:///shared/run1 or file://runs/bus")
        self.root = Path(path).expanduser()
        self.url = f"file://{self.root}"
        self._skipped: set[str] = set()  # odd entries already logged once

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        config: BusConfig | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        **settings: Any,
    ) -> DirectoryBus:
        """`file://PATH`; retry and client settings do not apply to a filesystem."""
        if not url.startswith("file://"):
            raise BusError(f"{url!r} is not a file:// URL")
        return cls(url[len("file://") :])

    # -- the run --------------------------------------------------------------------------------
    @contextmanager
    def _root(self) -> Iterator[int]:
        """The run directory's descriptor (the path the user gave may itself be a link)."""
        fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            yield fd
        finally:
            os.close(fd)

    @contextmanager
    def _subdir(self, root: int, name: str) -> Iterator[int]:
        """global/ or leases/ under the run directory, never through a symlink."""
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=root)
        except FileNotFoundError:
            raise BusError(f"{self.url}: {name}/ is missing") from None
        except OSError as error:  # ELOOP / ENOTDIR: a link or a file where the directory should be
            raise UnsafeLayout(
                f"{self.url}: {name}/ is not a plain directory ({error.strerror}); the bus never follows "
                f"links — remove {self.root / name} and restart the master"
            ) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _ensure_layout(self) -> None:
        """Create the directory layout (the master does this); refuse symlinked subdirectories."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with self._root() as root:
                for name in ("global", "deltas", "leases"):
                    with suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=root)
                    with self._subdir(root, name):
                        pass
        except PermissionError as error:
            raise PermissionDenied(f"cannot create the run directory {self.root}: {error.strerror}") from None
        except OSError as error:
            raise BusError(
                f"cannot create the run directory {self.root}: {error.strerror or error}"
            ) from None

    def create_run(self, *, private: bool = True, gated: bool = False) -> dict[str, Any]:
        self._ensure_layout()
        return {"owner": None, "private": None, "gated": None}

    def check_master_access(self) -> None:
        self._ensure_layout()
        try:
            with self._root() as root, self._subdir(root, "global") as gdir:
                for fd in (root, gdir):
                    probe = f".probe.{secrets.token_hex(4)}.tmp"
                    os.close(os.open(probe, _NEW_FLAGS, 0o666, dir_fd=fd))
                    os.unlink(probe, dir_fd=fd)
        except OSError as error:
            raise PermissionDenied(
                f"{self.url}: missing write permission on the run directory ({error.strerror})"
            ) from None

    def _read_regular(self, dir_fd: int, name: str, limit: int, what: str) -> tuple[bytes, str] | None:
        """(bytes, version) of regular file `name` in `dir_fd`, or None when there is none."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except PermissionError:
            raise PermissionDenied(f"{self.url}: no read permission on {what}") from None
        except OSError as error:  # ELOOP: a symlink
            raise BusError(
                f"{self.url}: cannot read {what} ({error.strerror}); it must be a regular file"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BusError(f"{self.url}: {what} is not a regular file")
            if info.st_size > limit:  # never read past what the caller can take
                raise OverLimit(f"{self.url}: {what} is over {limit} bytes", info.st_size)
            os.set_blocking(fd, True)
            data = _read_fd(fd, limit)
        finally:
            os.close(fd)
        if len(data) > limit:  # grew since the fstat
            raise OverLimit(f"{self.url}: {what} is over {limit} bytes", None)
        return data, _version(info)

    def _read_doc(self, name: str) -> tuple[dict[str, Any], str] | None:
        try:
            with self._root() as root:
                found = self._read_regular(root, name, MAX_DOC_BYTES, name)
        except FileNotFoundError:
            return None
        except PermissionError:
            raise PermissionDenied(f"{self.url}: no read permission on the run directory") from None
        except OSError as error:  # not a directory, a flaky mount
            raise TransientBusError(f"{self.url}: cannot read {name} ({error.strerror or error})") from None
        if found is None:
            return None
        return loads(found[0], f"{self.url}/{name}"), found[1]

    # -- documents ------------------------------------------------------------------------------
    def read_manifest(self) -> dict[str, Any] | None:
        found = self._read_doc(MANIFEST)
        return None if found is None else found[0]

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self._ensure_layout()
        self._write_root(MANIFEST, dumps(manifest))

    def _write_root(self, name: str, data: bytes) -> None:
        try:
            atomic_write_bytes(self.root / name, data)  # a rename replaces a planted link, never follows it
        except PermissionError:
            raise PermissionDenied(f"{self.url}: missing write permission on {name}") from None
        except OSError as error:
            raise TransientBusError(f"{self.url}: cannot write {name} ({error.strerror or error})") from None

    def read_head(self) -> Head | None:
        found = self._read_doc(HEAD)
        return None if found is None else Head(found[0], found[1])

    def read_global(self, head: Head) -> bytes:
        return self._read_global(head, 1 << 62)

    def read_global_capped(self, head: Head, max_bytes: int) -> bytes:
        try:
            return self._read_global(head, max_bytes)
        except OverLimit as error:
            raise too_large(self.url, str(head.get("global", "?")), error.size, max_bytes) from None

    def read_update_capped(self, head: Head, max_bytes: int) -> bytes:
        try:
            return self._read_global(head, max_bytes, "update")
        except OverLimit as error:
            raise too_large(self.url, str(head.get("update", "?")), error.size, max_bytes) from None

    def _read_global(self, head: Head, limit: int, key: str = "global") -> bytes:
        path = str(head.get(key, ""))
        folder, _, name = path.partition("/")
        pattern, prefix = (GLOBAL_RE, "outer") if key == "global" else (UPDATE_RE, "update")
        if folder != "global" or not pattern.match(name):
            raise BusError(
                f"{self.url}: head.json names the {key} {path!r}, "
                f"not global/{prefix}_<step>[.<random>].safetensors"
            )
        try:
            with self._root() as root, self._subdir(root, "global") as gdir:
                found = self._read_regular(gdir, name, limit, path)
        except OSError as error:
            raise TransientBusError(f"{self.url}: cannot read {path} ({error.strerror or error})") from None
        if found is None:
            raise BusError(f"{self.url}: {path} is missing")
        return found[0]

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The run's exclusive lock (publish, leases), waited for at most LOCK_WAIT_S seconds."""
        try:
            fd = os.open(self.root / LOCK_FILE, _LOCK_FLAGS, 0o666)
        except PermissionError:
            raise PermissionDenied(f"{self.url}: missing write permission on {LOCK_FILE}") from None
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link, a FIFO/socket, a directory
                raise BusError(
                    f"{self.url}: cannot open {LOCK_FILE} ({error.strerror}); it must be a regular file"
                ) from None
            # A read-only remount, a flaky mount: the bus is down for now, not misconfigured.
            raise TransientBusError(
                f"{self.url}: cannot open {LOCK_FILE} ({error.strerror or error})"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BusError(f"{self.url}: {LOCK_FILE} is not a regular file")
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TransientBusError(
                            f"{self.url}: {LOCK_FILE} has been locked for {LOCK_WAIT_S:.0f}s by another process"
                        ) from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def publish(
        self,
        data: bytes,
        head: dict[str, Any],
        *,
        expected: Head | None = None,
        prune: Sequence[str] = (),
        update: bytes | None = None,
    ) -> Head:
        self._ensure_layout()
        step = int(head["outer_step"])
        name = f"outer_{step:08d}.safetensors"
        document = dict(head)
        with self._locked():
            if expected is not None:
                current = self.read_head()
                if current is None or (
                    current.version != expected.version and dict(current) != dict(expected)
                ):
                    raise HeadMoved(
                        f"{self.url}: head.json moved to outer step "
                        f"{None if current is None else current.get('outer_step')} since this master read "
                        f"outer step {expected.get('outer_step')}"
                    )
            try:
                with self._root() as root, self._subdir(root, "global") as gdir:
                    if update is not None:  # before the head, like the global
                        document["update"] = "global/" + self._write_global_file(gdir, "update", step, update)
                    name = self._write_global_file(gdir, "outer", step, data)
            except PermissionError:
                raise PermissionDenied(f"{self.url}: missing write permission on global/") from None
            except OSError as error:
                raise TransientBusError(
                    f"{self.url}: cannot write global/{name} ({error.strerror or error})"
                ) from None
            self._write_root(HEAD, dumps({**document, "global": f"global/{name}"}))
            new = self.read_head()
        assert new is not None
        self._prune_globals(prune, keep={f"global/{name}", str(document.get("update", ""))})
        return new

    def _write_global_file(self, gdir: int, prefix: str, step: int, data: bytes) -> str:
        """Write global/<prefix>_<step>.safetensors; the name it went to (a directory planted under
        the name is never removed, stepped around)."""
        name = f"{prefix}_{step:08d}.safetensors"
        try:
            _write_at(gdir, name, data)
        except IsADirectoryError:
            taken, name = name, f"{prefix}_{step:08d}.{secrets.token_hex(4)}.safetensors"
            self._skip_once(f"global/{taken}", f"not a file; outer step {step} goes to {name}")
            _write_at(gdir, name, data)
        return name

    def _prune_globals(self, prune: Sequence[str], keep: set[str]) -> None:
        """Unlink the globals (and updates) named in `prune` (the caller's own, see Bus.publish) that are
        regular files, never those in `keep`; and this bus's stale temp files. Nothing else in global/
        is touched."""
        try:
            with self._root() as root, self._subdir(root, "global") as gdir:
                for path in dict.fromkeys(prune):
                    folder, _, name = str(path).partition("/")
                    if path in keep:
                        continue
                    if folder != "global" or not (GLOBAL_RE.match(name) or UPDATE_RE.match(name)):
                        self._skip_once(repr(path), "not a global/outer_<step> path; not pruned")
                        continue
                    try:
                        info = os.stat(name, dir_fd=gdir, follow_symlinks=False)
                        if not stat.S_ISREG(info.st_mode):
                            self._skip_once(path, "not a regular file; not pruned")
                            continue
                        os.unlink(name, dir_fd=gdir)
                    except FileNotFoundError:
                        continue
                    except OSError as error:
                        logger.warning("DiLoCo bus: cannot prune %s (%s)", path, error.strerror or error)
                now = time.time()
                for entry in os.scandir(gdir):
                    if GLOBAL_TMP_RE.match(entry.name):
                        info = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(info.st_mode) and now - info.st_mtime > STALE_TMP_S:
                            os.unlink(entry.name, dir_fd=gdir)
        except (OSError, BusError) as error:
            logger.warning("DiLoCo bus: cannot prune old globals in %s (%s)", self.url, error)

    def _skip_once(self, what: str, why: str) -> None:
        if what not in self._skipped:
            self._skipped.add(what)
            logger.warning("DiLoCo bus: ignoring %s (%s)", shown_name(what), why)

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
            return stat.S_ISREG(os.stat(self._node_dir(node) / name, follow_symlinks=False).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False  # not there (nor is its directory): confirmed absent
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
        """Log once per name (and reason) why a listed entry is left out."""
        key = f"{why}\0{what}"
        if key not in self._skipped:
            self._skipped.add(key)
            logger.warning(
                "DiLoCo bus: skipping deltas/%s (%s); it is never followed or read", shown_name(what), why
            )

    def list_deltas(
        self, collaborators: dict[str, dict[str, Any]] | None, *, exhaustive: bool = False
    ) -> list[DeltaRef]:
        # One listing of deltas/ is the whole cost: every poll is exhaustive here.
        refs: list[DeltaRef] = []
        try:
            with _open_dir(self.root / "deltas") as base:
                for node_entry in sorted(os.scandir(base), key=lambda e: e.name):
                    if node_entry.name.startswith("."):
                        continue
                    if not node_entry.name.isprintable():
                        self._skip(node_entry.name, "an unprintable name")
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
            if not entry.name.isprintable():
                self._skip(f"{node}/{entry.name}", "an unprintable name")
                continue
            if not os.access(entry.name, os.R_OK, dir_fd=node_fd, follow_symlinks=False):
                # Listed again once its permissions are fixed; said once, not at every poll.
                self._skip(f"{node}/{entry.name}", "no read permission; fix its permissions to have it read")
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
                    return _read_fd(fd, max_bytes)
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
        for path in (directory.parent, directory):  # deltas/ and deltas/<node>: written, never followed
            if path.is_symlink():
                raise PermissionDenied(
                    f"{self.url}: {path.relative_to(self.root)} is a symlink; the bus never writes through "
                    "links (remove it)"
                )
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe.{secrets.token_hex(4)}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            if error.errno == errno.EROFS:  # remounted read-only (an outage, a snapshot): retried
                raise TransientBusError(f"{self.url}: {directory} is read-only ({error.strerror})") from None
            raise PermissionDenied(
                f"{self.url}: missing write permission on {directory} ({error.strerror})"
            ) from None

    # -- leases ---------------------------------------------------------------------------------
    def _lease_name(self, name: str) -> str:
        if not NODE_RE.match(name):
            raise BusError(f"invalid lease name {name!r}")
        return f"{name}.json"

    def claim(self, name: str, holder: str, ttl_s: float) -> Claim:
        file = self._lease_name(name)
        self._ensure_layout()
        with self._locked(), self._root() as root, self._subdir(root, "leases") as ldir:
            now = time.time()
            found = self._read_regular(ldir, file, MAX_DOC_BYTES, f"leases/{file}")
            lease = {"name": name, "holder": holder, "expires_at": now + ttl_s, "taken_at": now}
            continued = False
            try:
                if found is None:
                    # O_EXCL: even a process that does not take the lock cannot create it twice.
                    fd = os.open(file, _NEW_FLAGS, 0o666, dir_fd=ldir)
                    try:
                        os.write(fd, dumps(lease))
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                else:
                    try:
                        current = loads(found[0], f"leases/{file}")
                        other, until = str(current.get("holder", "")), float(current.get("expires_at", 0))
                    except (BusError, TypeError, ValueError):
                        other, until = "", 0.0  # an unreadable lease protects nothing: taken over
                    # A lease lasts at most one ttl from when its file last changed (ctime: no one can
                    # set it ahead), whatever expiry it claims: a planted far-future one locks no one out.
                    written = min(os.stat(file, dir_fd=ldir, follow_symlinks=False).st_ctime, now)
                    until = min(until, written + ttl_s)
                    if other != holder and until > now:
                        raise _held(self.url, name, other, until - now)
                    continued = other == holder
                    _write_at(ldir, file, dumps(lease))  # a renewal, or the takeover of an expired lease
                version = _version(os.stat(file, dir_fd=ldir, follow_symlinks=False))
            except FileExistsError:
                raise _held(self.url, name, "another process", ttl_s) from None
            except PermissionError:
                raise PermissionDenied(f"{self.url}: missing write permission on leases/") from None
        return Claim(name, holder, lease["expires_at"], version, continued)

    def lease_left(self, name: str) -> float | None:
        file = self._lease_name(name)
        with self._root() as root, self._subdir(root, "leases") as ldir:
            found = self._read_regular(ldir, file, MAX_DOC_BYTES, f"leases/{file}")
            if found is None:
                return None
            now = time.time()
            try:
                lease = loads(found[0], f"leases/{file}")
                until, taken = float(lease.get("expires_at", 0)), float(lease.get("taken_at", now))
                written = min(os.stat(file, dir_fd=ldir, follow_symlinks=False).st_ctime, now)
            except (BusError, TypeError, ValueError, OSError):
                return 0.0  # unreadable: protects nothing
        # As claim() reads it: at most the ttl it was taken for, from when the file last changed.
        left = min(until, written + max(0.0, until - taken)) - now
        return max(0.0, left) if left == left else 0.0

    def release(self, claim: Claim) -> None:
        file = self._lease_name(claim.name)
        with self._locked(), self._root() as root, self._subdir(root, "leases") as ldir:
            found = self._read_regular(ldir, file, MAX_DOC_BYTES, f"leases/{file}")
            if found is None:
                return
            with suppress(BusError):
                if loads(found[0], f"leases/{file}").get("holder") != claim.holder:
                    return  # taken over since: not ours to remove
            try:
                os.unlink(file, dir_fd=ldir)
            except FileNotFoundError:
                pass
            except OSError as error:  # unwritable now: the lease lapses by itself
                raise TransientBusError(
                    f"{self.url}: cannot remove leases/{file} ({error.strerror})"
                ) from None


def _held(url: str, name: str, holder: str, left: float) -> ClaimHeld:
    shown = holder[:80]  # read from the bus: shown, never trusted
    return ClaimHeld(
        f"{url}: {name!r} is held by {shown!r} for another {max(0.0, left):.0f}s; another process runs as "
        f"{name} — use another id, or wait for its lease to expire",
        holder=shown,
        expires_in=max(0.0, left),
    )
