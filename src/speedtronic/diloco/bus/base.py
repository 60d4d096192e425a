"""The sealed sync-bus protocol: everything a DiLoCo role needs from storage, and nothing else.

A bus stores opaque bytes (safetensors) and small JSON documents; it never interprets tensors and
never unpickles. Layout, the same on every bus (a backend may spread it over several repos):

    manifest.json                     format, model fingerprint and specs, run summary, collaborators
    head.json                         outer step, updated_at, the global file's path, per-node
                                      high-water marks of processed deltas ("hwm")
    global/...                        the global model (safetensors, kind=global)
    deltas/<node>/<node>--<seq>.safetensors
    leases/<name>.json                who holds a node id (or the master role) until when

Role code (launch, master, coordinator, status) talks to a bus only through the methods below: no
`isinstance` on a backend, no private attribute, no backend-specific keys in documents. A backend is
chosen by URL scheme in `speedtronic.diloco.bus.registry.open_bus`; adding one is its module plus a
registration line. Every backend retries transient failures with the one policy in
`speedtronic.retry` and raises only BusError / TransientBusError / PermissionDenied (and the
subclasses here), with messages that never contain a credential.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from speedtronic.errors import BusError, PermissionDenied, TransientBusError

if TYPE_CHECKING:
    from speedtronic.config.distributed import BusConfig

__all__ = [
    "HEAD",
    "MANIFEST",
    "Bus",
    "BusError",
    "Claim",
    "ClaimHeld",
    "DeltaRef",
    "Head",
    "HeadMoved",
    "PermissionDenied",
    "TransientBusError",
    "UnsafeLayout",
    "dumps",
    "loads",
]

MANIFEST = "manifest.json"
HEAD = "head.json"


class Head(dict):  # type: ignore[type-arg]
    """The head document as stored, plus `version`: what identifies the stored version it was read
    at (a commit sha, an ETag, an inode+mtime). The version is never written into the document;
    `read_global(head)` and `publish(..., expected=head)` use it."""

    def __init__(self, document: dict[str, Any], version: str = "") -> None:
        super().__init__(document)
        self.version = version


@dataclass(frozen=True)
class DeltaRef:
    node: str  # the node the bus attributes the file to (its directory / delta repo)
    name: str  # file name, validated by the reader
    size: int | None
    where: str  # backend-specific location (a directory, repo:path, a key); opaque to roles
    # What identifies this version of the file (inode+mtime, a blob id, an ETag): a file rejected
    # once is not read again, but a new file under the same name is.
    etag: str = ""

    @property
    def id(self) -> str:
        return f"{self.node}/{self.name}"


def shown_name(name: str, limit: int = 200) -> str:
    """A name (or any text) read from a bus as a log line may show it: control characters (an ESC that
    would drive the terminal, a newline that would forge a log line) escaped, at most `limit` characters."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in name[:limit])


class GlobalTooLarge(BusError):
    """The global that head.json names is larger than the run's model can be: never read whole."""


def too_large(url: str, name: str, size: int | None, max_bytes: int) -> GlobalTooLarge:
    shown = "".join(c if c.isprintable() else "?" for c in name)[:120]
    what = f"{size:,} bytes" if size is not None else f"over {max_bytes:,} bytes"
    return GlobalTooLarge(
        f"{url}: the global model {shown!r} that head.json names is {what}, more than this run's model "
        f"can be ({max_bytes:,} bytes in fp32 with headers); it is not this run's global — check head.json "
        "and global/ on the bus"
    )


@dataclass(frozen=True)
class Claim:
    """A lease on a name (a node id, or "master"): held by `holder` until `expires_at` (Unix time)."""

    name: str
    holder: str
    expires_at: float
    version: str = ""  # the stored lease's version, for a conditional renewal or release
    # The lease this claim replaced was `holder`'s own (expired or not): nobody held the name since this
    # holder last wrote it, so a renewal that came late still proves the id was never someone else's.
    continued: bool = False


class ClaimHeld(BusError):
    """Another live holder has the lease on this name (a duplicate node id, a second master)."""

    exit_code = 2

    def __init__(self, message: str, holder: str = "", expires_in: float = 0.0) -> None:
        super().__init__(message)
        self.holder = holder
        self.expires_in = expires_in


class UnsafeLayout(PermissionDenied):
    """A link or special file stands where the bus's layout needs a plain directory (a symlinked
    global/): the bus never works through it, and role code stops (like a permission problem,
    retrying cannot fix it; an operator removes it)."""


class HeadMoved(BusError):
    """`publish(..., expected=head)` found a newer head than `expected`: someone else (a second
    master) advanced the run; nothing was written."""


class Bus(ABC):
    """One run's storage. Methods raise BusError / TransientBusError / PermissionDenied."""

    url: str  # for messages and logs; never contains a credential
    scheme: ClassVar[str] = ""  # the registry key: "file", "hub", "s3", …
    # Whether `speedtronic master` may create the run itself when no manifest is there (a directory
    # or a bucket prefix: yes; the Hub: `hub init` creates the repo with its visibility first).
    creates_on_master_start: ClassVar[bool] = False
    # The master's default lease (distributed.master.lease_s unset), renewed every third of it: a
    # takeover within a minute where a renewal is a small write; longer where it costs a commit.
    master_lease_s: ClassVar[float] = 60.0

    @classmethod
    @abstractmethod
    def from_url(
        cls,
        url: str,
        *,
        config: BusConfig | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        **settings: Any,
    ) -> Bus:
        """The bus for `url` (its scheme is this backend's). `config` is the run's `distributed.bus`
        section (retry settings, endpoint, token, budgets) or None; `endpoint` and `token` come from
        the command line and win over it; `settings` override client settings (e.g. retry_budget_s)."""

    # -- the run --------------------------------------------------------------------------------
    @abstractmethod
    def create_run(self, *, private: bool = True, gated: bool = False) -> dict[str, Any]:
        """Create the storage of a new run (a directory, a repo, a checked bucket prefix). Returns
        facts for the caller: {"owner": the identity that now owns the run or None, "private",
        "gated"} (None where the backend has no such notion), and optionally "delta_repo": where the
        owner's own node ("master") sends its deltas (absent or None: the run itself). With an owner,
        the caller lists it in the manifest as collaborator "master". Writing the manifest and the
        first global is the caller's (`write_manifest`, `publish`)."""

    def check_master_access(self) -> None:
        """Raise PermissionDenied unless this process can write the run (manifest, head, global);
        also repairs what a run created by an older version lacks (the Hub's run tag)."""
        return None

    @abstractmethod
    def check_worker_access(self, node: str) -> None:
        """Raise PermissionDenied unless this process can read the run and write `node`'s deltas
        (creating what the node's writes need, such as its own delta repo)."""

    def add_collaborator(
        self, user: str, node: str, delta_location: str | None, *, record_only: bool = False
    ) -> dict[str, Any]:
        """Give `user` (who will run node `node`) what it needs to take part. Returns
        {"delta_repo": where its deltas go (None: the run itself), "granted_read_access": bool or
        None where access is not the bus's to grant, "warning": a line the user must see or None}.
        Where the bus knows `user` could not read the run it raises ConfigError naming the fix, or,
        with `record_only`, returns the reason as the warning. The caller records the collaborator in
        the manifest."""
        return {"delta_repo": delta_location, "granted_read_access": None, "warning": None}

    # -- documents ------------------------------------------------------------------------------
    @abstractmethod
    def read_manifest(self) -> dict[str, Any] | None:
        """The run's manifest.json, or None when there is none."""

    @abstractmethod
    def write_manifest(self, manifest: dict[str, Any]) -> None: ...

    @abstractmethod
    def read_head(self) -> Head | None:
        """The current head.json with its version, or None before the first publish."""

    @abstractmethod
    def read_global(self, head: Head) -> bytes:
        """The global model file that `head` names, as of `head.version` (never a newer one)."""

    def read_global_capped(self, head: Head, max_bytes: int) -> bytes:
        """`read_global`, refused (GlobalTooLarge, one line) when the file is over `max_bytes` (what
        the run's model can be: spec.global_bytes_cap). The built-in buses never read more than that;
        this default, for a plugin's bus, checks after its `read_global`."""
        data = self.read_global(head)
        if len(data) > max_bytes:
            raise too_large(self.url, str(head.get("global", "?")), len(data), max_bytes)
        return data

    # Whether `publish(update=)` stores a global's update file (diloco/global_update.py) next to it and
    # `read_update_capped` reads it back. A bus without it (a plugin's) is never given one: the master
    # publishes full globals only.
    supports_updates: ClassVar[bool] = False

    def read_update_capped(self, head: Head, max_bytes: int) -> bytes:
        """The update file that `head` names (head["update"]), as of `head.version`, refused past
        `max_bytes` like `read_global_capped`."""
        raise BusError(f"{self.url}: this bus does not store global updates")

    @abstractmethod
    def publish(
        self,
        data: bytes,
        head: dict[str, Any],
        *,
        expected: Head | None = None,
        prune: Sequence[str] = (),
        update: bytes | None = None,
    ) -> Head:
        """Store a new global model, then a head that points at it (readers never see a torn pair);
        returns the new head. With `expected`, raise HeadMoved (writing nothing visible) when the
        stored head is no longer `expected` — two masters cannot both advance one run.

        After the new head is stored, delete the globals named in `prune` — paths the caller's own
        earlier publishes returned as `head["global"]` — and nothing else: a backend never deletes
        by pattern, never the global the new head names, and never a name that is not one of its
        own global paths (logged, left). A failed deletion is logged: old globals cost storage,
        not correctness.

        With `update` (only where `supports_updates`): store it too, before the head, and name it in the
        new head's "update" (a path `prune` may name later, like a global's)."""

    # -- deltas ---------------------------------------------------------------------------------
    @abstractmethod
    def put_delta(self, node: str, name: str, data: bytes, *, prune: list[str] = ()) -> None:
        """Publish one delta for `node`, written once (and delete that node's already-processed
        `prune` files where the writer may)."""

    @abstractmethod
    def delta_exists(self, node: str, name: str) -> bool: ...

    @abstractmethod
    def list_own_deltas(self, node: str) -> list[str]:
        """File names of `node`'s deltas still on the bus."""

    @abstractmethod
    def list_deltas(
        self, collaborators: dict[str, dict[str, Any]] | None, *, exhaustive: bool = False
    ) -> list[DeltaRef]:
        """Deltas waiting on the bus, from the listed collaborators (None: from everyone). A poll
        may spread costly look-ups over several calls; `exhaustive` (a status check) does them all."""

    def unclaimed_sources(self) -> set[str]:
        """What the latest `list_deltas` saw that no listed collaborator owns and whose files it could
        not list (a delta repo carrying the run's tag, on the Hub): a sign that a collaborator was
        added, so the master re-reads the manifest soon. Empty where the listing shows everyone's
        files (an unlisted node's files are the sign there)."""
        return set()

    @abstractmethod
    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes:
        """At most max_bytes + 1 bytes of the delta (the decoder rejects anything longer)."""

    @abstractmethod
    def delete_deltas(self, refs: list[DeltaRef]) -> None:
        """Remove processed deltas where this process may (a Hub master cannot touch others' repos)."""

    # -- leases ---------------------------------------------------------------------------------
    @abstractmethod
    def claim(self, name: str, holder: str, ttl_s: float) -> Claim:
        """Take or renew the lease on `name` for `holder` for `ttl_s` seconds. Succeeds when no lease
        is there, it has expired, or `holder` already holds it; raises ClaimHeld naming the other
        holder otherwise. Two processes racing for a free lease: exactly one wins. The Claim says whether
        the lease it replaced was `holder`'s own (`continued`)."""

    @abstractmethod
    def release(self, claim: Claim) -> None:
        """Give the lease up (only if `claim.holder` still holds it)."""

    def lease_left(self, name: str) -> float | None:
        """Seconds left on the lease on `name` (0 once expired or unreadable; None when there is none, or
        where a backend cannot say). Read only: the master asks it of a silent node before the run's end
        counts it as left (a worker that is restarting still holds its id)."""
        return None

    def reads_leases(self) -> bool:
        """Whether `lease_left`'s None means "nobody holds it" (a backend that reads leases) rather
        than "cannot say": the rounds stop waiting for a node without one (master/departures.py)."""
        return type(self).lease_left is not Bus.lease_left

    # -- upkeep ---------------------------------------------------------------------------------
    def requests_spent(self) -> int | None:
        """Requests spent listing deltas so far (a running count the master turns into requests per
        poll for its pacing and metrics), or None where a backend does not count them."""
        return None

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

    def __enter__(self) -> Bus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
