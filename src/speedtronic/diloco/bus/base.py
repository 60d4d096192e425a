"""The sync bus interface: where a DiLoCo run keeps its manifest, global model and deltas.

A bus stores opaque bytes (safetensors) and small JSON documents; it never interprets tensors and
never unpickles. Layout, the same on every bus:

    manifest.json                     format, model fingerprint and specs, run summary, collaborators
    head.json                         outer step, updated_at, the global file's path, per-node
                                      high-water marks of processed deltas ("hwm")
    global/...                        the global model (safetensors, kind=global)
    deltas/<node>/<node>--<seq>.safetensors

`open_bus(repo)` picks the implementation: `file://PATH` → DirectoryBus, `owner/name` → HubBus.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from speedtronic.errors import BusError, PermissionDenied, TransientBusError

__all__ = ["HEAD", "MANIFEST", "Bus", "BusError", "DeltaRef", "PermissionDenied", "TransientBusError"]

MANIFEST = "manifest.json"
HEAD = "head.json"


@dataclass(frozen=True)
class DeltaRef:
    node: str  # the node the bus attributes the file to (its directory / delta repo)
    name: str  # file name, validated by the reader
    size: int | None
    where: str  # bus-specific location (a directory or a repo id)
    # What identifies this version of the file (inode+mtime, a blob id): a file rejected once is not
    # read again, but a new file under the same name is.
    etag: str = ""

    @property
    def id(self) -> str:
        return f"{self.node}/{self.name}"


class Bus(ABC):
    """One run's storage. Methods raise BusError/TransientBusError/PermissionDenied."""

    url: str

    # -- run documents --------------------------------------------------------------------------
    @abstractmethod
    def read_json(self, path: str) -> dict[str, Any] | None:
        """A JSON document of the run, or None when it does not exist."""

    @abstractmethod
    def write_json(self, path: str, data: dict[str, Any]) -> None: ...

    def read_manifest(self) -> dict[str, Any] | None:
        return self.read_json(MANIFEST)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self.write_json(MANIFEST, manifest)

    def read_head(self) -> dict[str, Any] | None:
        return self.read_json(HEAD)

    @abstractmethod
    def read_file(self, path: str) -> bytes:
        """A file of the run repo/directory at the current head (e.g. the global named in head.json)."""

    @abstractmethod
    def publish_global(self, data: bytes, head: dict[str, Any]) -> None:
        """Store a new global model and then a head that points at it (readers never see a torn pair)."""

    # -- deltas ---------------------------------------------------------------------------------
    @abstractmethod
    def put_delta(self, node: str, name: str, data: bytes, *, prune: list[str] = ()) -> None:
        """Publish one delta for `node` (and delete that node's already-processed `prune` files)."""

    @abstractmethod
    def delta_exists(self, node: str, name: str) -> bool: ...

    @abstractmethod
    def list_own_deltas(self, node: str) -> list[str]:
        """File names of `node`'s deltas still on the bus."""

    @abstractmethod
    def list_deltas(self, collaborators: dict[str, dict[str, Any]] | None) -> list[DeltaRef]:
        """Deltas waiting on the bus, from the listed collaborators (None: from everyone)."""

    @abstractmethod
    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes: ...

    @abstractmethod
    def delete_deltas(self, refs: list[DeltaRef]) -> None:
        """Remove processed deltas where this process may (a Hub master cannot touch others' repos)."""

    # -- access ---------------------------------------------------------------------------------
    @abstractmethod
    def check_worker_access(self, node: str) -> None:
        """Raise PermissionDenied unless this process can read the run and write `node`'s deltas."""

    def poll_delay(self, interval: float, cost: float) -> float:
        """Seconds until the master's next poll, given its configured interval and what a poll costs
        (a Hub bus stretches it to fit its request budget)."""
        return interval

    def compact(self) -> None:
        """Reclaim storage that history keeps (Hub: squash); a no-op where there is none."""
        return None

    def close(self) -> None:
        """Release connections."""
        return None


def dumps(data: dict[str, Any]) -> bytes:
    return (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()


def loads(raw: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as error:
        raise BusError(f"{what} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise BusError(f"{what} is not a JSON object")
    return data


def open_bus(
    repo: str, *, config: Any = None, endpoint: str | None = None, token: str | None = None, **hub: Any
) -> Bus:
    """The bus for REPO: `file://PATH` (directory) or `owner/name` (Hugging Face Hub; `hub` overrides
    client settings, e.g. retry_budget_s)."""
    if repo.startswith("file://"):
        from speedtronic.diloco.bus.directory import DirectoryBus

        return DirectoryBus(repo[len("file://") :])
    from speedtronic.diloco.bus.hub import HubBus

    return HubBus(repo, config=config, endpoint=endpoint, token=token, **hub)
