"""The training master's own deltas, kept in-process: a Bus wrapper for `speedtronic master` with
`distributed.master.trains`.

The master's own node (a Coordinator in the master's process, on the same bus object as the Master)
has no reason to send its deltas through the run's storage: on the Hub every delta is a commit from
the run repo's ~128 per hour (and deleting it after the round another), which paced whole rounds in
a 5-node run. This wrapper keeps that one node's deltas in a local directory under the master's
state directory (`<state_dir>/deltas/<node>/`, files written atomically, so a restarted master finds
them where it left them) and merges them into `list_deltas`; the Master reads and deletes them there
like any other delta (the same checks apply). Every other call — and every other node's delta — goes
to the real bus unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speedtronic.atomic_files import atomic_write_bytes
from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import Bus, BusError, Claim, DeltaRef, Head

LOCAL = "local:"  # DeltaRef.where prefix of the files this wrapper keeps


class LocalDeltas(Bus):
    """`inner`, except that node `node`'s deltas live in `directory`/<node>/ on this machine."""

    def __init__(self, inner: Bus, node: str, directory: str | Path) -> None:
        if not codec.NODE_RE.match(node):
            raise BusError(f"invalid node id {node!r}")  # it names a local directory
        self.inner = inner
        self.node = node
        self.folder = Path(directory) / node
        self.url = inner.url
        # The backend's class-level facts (e.g. the Hub's longer master lease), not Bus's defaults.
        for fact in ("scheme", "creates_on_master_start", "master_lease_s"):
            if hasattr(inner, fact):
                setattr(self, fact, getattr(inner, fact))

    def __getattr__(self, name: str) -> Any:
        # Backend extras (request counters, a Hub client's api) stay reachable for callers and tests.
        return getattr(self.inner, name)

    @classmethod
    def from_url(cls, url: str, **_: Any) -> Bus:
        raise BusError("LocalDeltas wraps an open bus; open the run with open_bus")

    def _mine(self, node: str) -> bool:
        return node == self.node

    def _path(self, name: str) -> Path:
        if not codec.DELTA_NAME_RE.match(name):
            raise BusError(f"{self.folder}: not a delta file name: {name!r}")
        return self.folder / name

    # -- the run and documents: the real bus -----------------------------------------------------
    def create_run(self, *, private: bool = True, gated: bool = False) -> dict[str, Any]:
        return self.inner.create_run(private=private, gated=gated)

    def check_master_access(self) -> None:
        self.inner.check_master_access()

    def check_worker_access(self, node: str) -> None:
        self.inner.check_worker_access(node)  # the node still reads the run from the real bus
        if self._mine(node):
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise BusError(f"{self.folder}: cannot keep the master's own deltas here ({error})") from None

    def add_collaborator(
        self, user: str, node: str, delta_location: str | None, *, record_only: bool = False
    ) -> dict[str, Any]:
        return self.inner.add_collaborator(user, node, delta_location, record_only=record_only)

    def read_manifest(self) -> dict[str, Any] | None:
        return self.inner.read_manifest()

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self.inner.write_manifest(manifest)

    def read_head(self) -> Head | None:
        return self.inner.read_head()

    def read_global(self, head: Head) -> bytes:
        return self.inner.read_global(head)

    def read_global_capped(self, head: Head, max_bytes: int) -> bytes:
        return self.inner.read_global_capped(head, max_bytes)

    @property
    def supports_updates(self) -> bool:  # type: ignore[override]
        return self.inner.supports_updates

    def read_update_capped(self, head: Head, max_bytes: int) -> bytes:
        return self.inner.read_update_capped(head, max_bytes)

    def publish(
        self,
        data: bytes,
        head: dict[str, Any],
        *,
        expected: Head | None = None,
        prune: Any = (),
        update: bytes | None = None,
    ) -> Head:
        if update is None:  # a plugin's inner bus may not take the keyword
            return self.inner.publish(data, head, expected=expected, prune=prune)
        return self.inner.publish(data, head, expected=expected, prune=prune, update=update)

    # -- deltas: the master's own node here, everyone else on the bus -----------------------------
    def put_delta(self, node: str, name: str, data: bytes, *, prune: list[str] = ()) -> None:
        if not self._mine(node):
            return self.inner.put_delta(node, name, data, prune=prune)
        path = self._path(name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, data)
        except OSError as error:
            raise BusError(f"{path}: could not write the delta ({error})") from None
        for old in prune:
            self._path(old).unlink(missing_ok=True)
        return None

    def delta_exists(self, node: str, name: str) -> bool:
        if not self._mine(node):
            return self.inner.delta_exists(node, name)
        return self._path(name).is_file()

    def list_own_deltas(self, node: str) -> list[str]:
        if not self._mine(node):
            return self.inner.list_own_deltas(node)
        return sorted(p.name for p in self._files())

    def _files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return [p for p in self.folder.iterdir() if p.is_file() and codec.DELTA_NAME_RE.match(p.name)]

    def list_deltas(
        self, collaborators: dict[str, dict[str, Any]] | None, *, exhaustive: bool = False
    ) -> list[DeltaRef]:
        refs = self.inner.list_deltas(collaborators, exhaustive=exhaustive)
        if collaborators is not None and self.node not in collaborators:
            return refs
        for path in sorted(self._files()):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted since the listing
            etag = f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"
            refs.append(DeltaRef(self.node, path.name, st.st_size, LOCAL + str(path), etag))
        return refs

    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes:
        if not ref.where.startswith(LOCAL):
            return self.inner.get_delta(ref, max_bytes)
        try:
            with open(ref.where[len(LOCAL) :], "rb") as handle:
                return handle.read(max_bytes + 1)
        except OSError as error:
            raise BusError(f"{ref.where[len(LOCAL) :]}: could not read the delta ({error})") from None

    def delete_deltas(self, refs: list[DeltaRef]) -> None:
        others = [r for r in refs if not r.where.startswith(LOCAL)]
        for ref in refs:
            if ref.where.startswith(LOCAL):
                Path(ref.where[len(LOCAL) :]).unlink(missing_ok=True)
        if others:
            self.inner.delete_deltas(others)

    # -- leases and upkeep: the real bus -----------------------------------------------------------
    def claim(self, name: str, holder: str, ttl_s: float) -> Claim:
        return self.inner.claim(name, holder, ttl_s)

    def release(self, claim: Claim) -> None:
        self.inner.release(claim)

    def lease_left(self, name: str) -> float | None:
        return self.inner.lease_left(name)

    def reads_leases(self) -> bool:
        return self.inner.reads_leases()

    def requests_spent(self) -> int | None:
        return self.inner.requests_spent()

    def poll_delay(self, interval: float, cost: float) -> float:
        return self.inner.poll_delay(interval, cost)

    def compact(self) -> None:
        self.inner.compact()

    def close(self) -> None:
        self.inner.close()
