"""One process per run directory: an advisory lock that `train`, `worker` and `master` take on the
directory they write (checkpoints, metrics, the master's state) for as long as they write it.

Why: two runs on one output directory overwrite each other's checkpoints and `latest` pointer; before
this lock the second died later with a misleading "make sure checkpoint.directory is writable". The
lock is `flock` on `<dir>/.speedtronic.lock`, so the kernel drops it when the holder exits in any way
(kill -9 included) and a stale lock file never blocks anyone. The file records who holds it (host,
pid, since) for the error message. Re-entrant within a process (a refcount per directory), so a
Trainer built twice in one process (a resume in a notebook) does not lock itself out.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from speedtronic.errors import ConfigError

LOCK_FILE = ".speedtronic.lock"

try:
    import fcntl
except ImportError:  # pragma: no cover — Windows: no advisory locks; runs are not guarded there
    fcntl = None  # type: ignore[assignment]


class RunDirInUse(ConfigError):
    """Another live process holds this run directory (exit 2: pick another run name or wait)."""


_held: dict[str, list[Any]] = {}  # resolved directory → [fd, refcount]
_guard = threading.Lock()


def acquire(directory: str | Path, what: str = "run.output_dir") -> str:
    """Take the lock on `directory` (created if missing) or raise RunDirInUse naming the holder and
    `what` setting to change. Returns the key to pass to `release`."""
    path = Path(directory).resolve()
    key = str(path)
    with _guard:
        if key in _held:
            _held[key][1] += 1
            return key
        if fcntl is None:
            _held[key] = [-1, 1]
            return key
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirInUse(
                f"{path} is in use by another speedtronic process ({holder}): two runs on one directory "
                f"would overwrite each other's checkpoints; wait for it to end, or give this run another "
                f"{what} (or run.name)"
            ) from None
        os.ftruncate(fd, 0)
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.write(fd, (json.dumps(record) + "\n").encode())
        _held[key] = [fd, 1]
        return key


def release(key: str) -> None:
    """Give back one `acquire` of this directory; the lock goes when the last one is released."""
    with _guard:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
        if entry[0] >= 0:
            os.close(entry[0])  # closing the descriptor drops the flock


def _holder(fd: int) -> str:
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(record['pid'])} on {str(record['host'])[:64]}, since {str(record['since'])[:32]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"
