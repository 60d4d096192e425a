"""Crash-safe file replacement, shared by checkpoints, the directory sync bus and the DiLoCo master.

A reader sees the old file or the new one, never a torn mix: the data goes to a hidden temp file
next to the target (`.NAME.<hex>.tmp`, which the cleaners of stale temp files look for), is fsynced,
renamed over the target, and the directory is fsynced so the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_dir(directory: Path) -> None:
    """Make renames in `directory` durable; without it a power cut can forget the new entry."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_beside(final: Path) -> tuple[Path, int]:
    """A new hidden temp file next to ``final`` and its descriptor (open for writing)."""
    tmp = final.parent / f".{final.name}.{secrets.token_hex(4)}.tmp"
    # 0o666 & ~umask, like open(); mkstemp's 0o600 would make files unreadable to the group.
    return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)


def atomic_write(final: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Call ``write(fileobj)`` on a hidden temp file next to ``final``, fsync it and rename it into place."""
    tmp, fd = _temp_beside(final)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def atomic_write_bytes(final: Path, data: bytes) -> None:
    atomic_write(final, lambda f: f.write(data))


def atomic_write_path(final: Path, write: Callable[[Path], object]) -> None:
    """`atomic_write` for a writer that takes a file name, not a file object (safetensors' save_file):
    ``write(tmp)`` fills the hidden temp file, which keeps the usual permissions (0o666 less the umask,
    whatever mode the writer would create a file with), and is then fsynced and renamed into place."""
    tmp, fd = _temp_beside(final)
    os.close(fd)
    try:
        mode = os.stat(tmp).st_mode & 0o777
        write(tmp)
        os.chmod(tmp, mode)  # a writer that replaced the file (rather than filling it) made it its own
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def atomic_write_text(final: Path, text: str) -> None:
    atomic_write_bytes(final, text.encode("utf-8"))
