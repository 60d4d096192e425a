"""A node restarted where its predecessor died: the lease holder recorded in the node's own state
directory, and the directory's lock.

A master's state directory, or a worker's node directory (`<output_dir>/<node>/`), records the lease
holder token of the process that last ran on it. A process restarted there whose predecessor was a
process of this host that is gone (kill -9, a crash, an OOM kill) takes that predecessor's lease back
at once instead of waiting a whole lease for a process that no longer exists. Two guards keep this
from ever letting two live processes share an id:

- the directory's lock (flock, held for the process's life and dropped by the kernel when it dies):
  a second live process of this machine on the same directory cannot take it;
- the predecessor must be of this host and its pid gone (`os.kill(pid, 0)`); a frozen process
  (SIGSTOP) is alive, so its lease is not taken back here: it lapses as usual.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from speedtronic.atomic_files import atomic_write_bytes


class DirectoryHeld(OSError):
    """Another live process of this machine holds the directory's lock."""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, someone else's
    return False


def lock_directory(state_dir: Path, lock_name: str, *, wait: bool = False) -> IO[str] | None:
    """Take `state_dir`'s lock for this process's life (the open file: keep it). DirectoryHeld when
    another live process holds it (with `wait`: wait for it); None where there is no flock (then no
    predecessor is trusted)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    lock = open(state_dir / lock_name, "a+")  # noqa: SIM115 - held open until the process ends
    try:
        import fcntl
    except ImportError:
        lock.close()
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        lock.close()
        raise DirectoryHeld(f"{state_dir}: another process of this machine runs on it") from None
    return lock


def recorded_holder(state_dir: Path, holder_file: str) -> str | None:
    """The lease holder that `state_dir` records (the process that runs, or last ran, on it)."""
    try:
        before = json.loads((state_dir / holder_file).read_text(encoding="utf-8")).get("holder")
    except (OSError, ValueError, AttributeError):
        return None
    return before if isinstance(before, str) else None


def gone_predecessor(state_dir: Path, holder_file: str, holder: str) -> str | None:
    """The holder recorded in `state_dir` if it was a process of this host that is gone; records
    `holder` (this process) in its place. Call with the directory's lock held."""
    path = state_dir / holder_file
    before = recorded_holder(state_dir, holder_file)
    atomic_write_bytes(path, (json.dumps({"holder": holder}) + "\n").encode())
    parts = before.split("/") if before is not None else []
    host = holder.split("/")[0]
    gone = len(parts) == 3 and parts[0] == host and parts[1].isdigit() and _gone(int(parts[1]))
    return before if gone else None
