"""The S3 bus (`s3://BUCKET/PREFIX`): AWS S3 and S3-compatible stores (Cloudflare R2, MinIO, Hugging
Face Storage Buckets through their S3 gateway), for runs whose nodes share a bucket but no filesystem.

Layout under PREFIX (the one every bus has, see base.py):

    manifest.json, head.json
    global/outer_NNNNNNNN.safetensors    immutable: written with If-None-Match: *; publish(prune=)
                                         deletes exactly the globals the master names (its own)
    deltas/<node>/<node>--<seq>.safetensors   written once (If-None-Match: *)
    leases/<name>.json                   claimed with If-None-Match: * (free) or If-Match (renew, takeover)

Correctness rests on the store's conditional writes, not on timing:
- publish writes the global, then head.json with If-Match on the head it was computed from (or
  If-None-Match: * for the first head): two masters cannot both advance a run; the loser gets HeadMoved.
  A global name already taken by different bytes (a master killed between its global and its head, or
  a rival mid-publish) is never overwritten — a reader could pair it with the wrong head — the global
  goes to `outer_NNNNNNNN.<random>.safetensors` instead, and the head names whichever file is its own.
- A PUT that lands but whose answer is lost is retried and then refused (the object exists, or the
  ETag moved): every conditional write compares what is stored with what it meant to write, and takes
  identical bytes as its own success (MD5 ETag first, the bytes themselves when the ETag is not an MD5).
- Leases expire by the store's clock (the lease's Last-Modified against the response's Date), so
  nodes with skewed clocks agree on who holds what. Release is a conditional delete (If-Match) where
  the store supports it, else a re-check of the holder, then a delete.
- `create_run` checks the bucket, refuses a prefix that holds a run, and verifies that the store
  really enforces If-None-Match and If-Match (a store that ignores them would let two masters or two
  writers both win): such a store is refused with a clear error instead of trusted.

Everything under deltas/ is hostile: one paginated ListObjectsV2 per poll; keys that are not exactly
deltas/<valid node id>/<name> are skipped (logged once, with repr: keys may hold newlines); reads are
ranged and capped at max_bytes + 1, made If-Match on the listed ETag (a replaced object is refused);
keys are never turned into local paths. Documents are read up to MAX_DOC_BYTES.

Credentials come from the standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE and
~/.aws, instance and container roles); `--token` is not used. The secret key and session token are
remembered by speedtronic.secrets, so every message is scrubbed of them, and no message, log line or
repr names them (`url` is just s3://bucket/prefix). The endpoint: `--endpoint`, then
distributed.bus.endpoint, then AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS. botocore retries are off
(one attempt; timeouts from distributed.bus.request_timeout): speedtronic.retry's policy retries
throttling, 5xx, timeouts and connection errors, waiting a Retry-After when the store sends one.

Stores differ; what this module does about it:
- AWS S3: conditional PUTs since 2024 (If-None-Match August, If-Match November); conditional
  DELETE on general purpose buckets came later, hence the release fallback. Without s3:ListBucket,
  S3 answers 403 (not 404) for a missing key, so every node needs ListBucket on the prefix.
- Cloudflare R2: region `auto` (or us-east-1); set it with AWS_DEFAULT_REGION=auto. ETags are MD5
  for single-part uploads. Its S3 API refused some of botocore's default flexible checksums, so
  checksums are sent only where an operation requires them (request_checksum_calculation=when_required).
- MinIO: path-style addressing unless MINIO_DOMAIN is set; with an explicit endpoint this bus
  uses path style unless ~/.aws/config sets s3.addressing_style. Releases before 2024 ignore
  conditional PUTs: create_run refuses them.
- Hugging Face Storage Buckets: endpoint https://s3.hf.co, credentials from "Generate S3 credentials"
  on an access token (HFAK… keys), not the HF token. Buckets are mutable and unversioned, which is all
  this layout needs; create_run checks that the gateway enforces the conditional writes.
- Single PUTs only (no multipart): a global or delta must stay under 5 GB.

The client (boto3, an optional extra imported only when a bus is opened) and the meaning of each
botocore failure live in s3_client.py.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any, TypeVar

from speedtronic.diloco.bus.base import (
    HEAD,
    MANIFEST,
    Bus,
    Claim,
    ClaimHeld,
    DeltaRef,
    Head,
    HeadMoved,
    dumps,
    loads,
    too_large,
)
from speedtronic.diloco.bus.s3_client import (
    Conflict,
    Missing,
    NotModified,
    Unsupported,
    classify,
    make_client,
    parse_url,
    resolve_endpoint,
)
from speedtronic.diloco.codec import DELTA_NAME_RE, NODE_RE
from speedtronic.errors import BusError, ConfigError, PermissionDenied, TransientBusError
from speedtronic.retry import RetryPolicy
from speedtronic.secrets import scrub

if TYPE_CHECKING:
    from speedtronic.config.distributed import BusConfig

logger = logging.getLogger("speedtronic.diloco")
T = TypeVar("T")
MAX_DOC_BYTES = 64 << 20  # manifest, head, leases: JSON from the bus, read up to this
MAX_BATCH_DELETE = 1000  # keys per DeleteObjects request (S3's own limit)
MAX_LEASE_S = 7 * 86400.0  # a lease claiming to last longer is someone's junk: it counts as this long
_GLOBAL_RE = re.compile(r"^global/outer_(\d{8,12})(?:\.[0-9a-f]{8})?\.safetensors$")
_UPDATE_RE = re.compile(r"^global/update_(\d{8,12})(?:\.[0-9a-f]{8})?\.safetensors$")  # a global's update
_MD5_RE = re.compile(r"^[0-9a-f]{32}$")


class S3Bus(Bus):
    scheme = "s3"
    creates_on_master_start = True
    supports_updates = True

    def __init__(self, bucket: str, prefix: str, client: Any, policy: RetryPolicy, endpoint: str | None):
        self.bucket = bucket
        self.prefix = prefix
        self.client = client
        self.policy = policy
        self.endpoint = endpoint
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._skipped: set[str] = set()
        self._head_seen: tuple[str, dict[str, Any]] | None = None  # (ETag, head.json at it)
        self._conditional_delete = True
        self._batch_delete = True  # DeleteObjects, until a store says NotImplemented
        self.page_size = 1000  # keys per ListObjectsV2 page (S3's maximum)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        config: BusConfig | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        **settings: Any,
    ) -> S3Bus:
        bucket, prefix = parse_url(url)
        endpoint = resolve_endpoint(endpoint, config)
        policy = RetryPolicy.from_config(
            config,
            initial=settings.get("retry_initial"),
            max_delay=settings.get("retry_max"),
            attempts=settings.get("retry_attempts"),
            budget_s=settings.get("retry_budget_s"),
        )
        timeout = settings.get("request_timeout") or (config.request_timeout if config is not None else 60.0)
        client = make_client(
            endpoint, float(timeout), settings.get("region"), settings.get("addressing_style")
        )
        return cls(bucket, prefix, client, policy, endpoint)

    def __repr__(self) -> str:
        return f"S3Bus({self.url!r})"

    # -- requests -------------------------------------------------------------------------------
    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _target(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _call(self, what: str, fn: Callable[[], T], permission: str, key: str) -> T:
        def meaning(error: Exception, what: str) -> BusError:
            return classify(error, f"{self.url}: {what}", permission, self._target(key), self.endpoint)

        return self.policy.call(what, fn, meaning)

    def _get(
        self, key: str, what: str, limit: int | None = MAX_DOC_BYTES, **conditions: Any
    ) -> tuple[bytes, dict[str, Any]]:
        """(at most `limit` bytes of the object (None: all), the response without its body)."""

        def fetch() -> tuple[bytes, dict[str, Any]]:
            response = self.client.get_object(Bucket=self.bucket, Key=key, **conditions)
            body = response.pop("Body")
            try:
                if limit is None:
                    return body.read(), response
                chunks, left = [], limit
                while left > 0:  # in pieces: never a buffer the size of the limit
                    chunk = body.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left -= len(chunk)
                return b"".join(chunks), response
            finally:
                body.close()

        return self._call(what, fetch, "s3:GetObject", key)

    def _put(self, key: str, data: bytes, what: str, **conditions: Any) -> dict[str, Any]:
        put = self.client.put_object
        return self._call(
            what, lambda: put(Bucket=self.bucket, Key=key, Body=data, **conditions), "s3:PutObject", key
        )

    def _head(self, key: str, what: str) -> dict[str, Any] | None:
        try:
            return self._call(
                what, lambda: self.client.head_object(Bucket=self.bucket, Key=key), "s3:GetObject", key
            )
        except Missing:
            return None

    def _delete(self, key: str, what: str, **conditions: Any) -> None:
        delete = self.client.delete_object
        self._call(what, lambda: delete(Bucket=self.bucket, Key=key, **conditions), "s3:DeleteObject", key)

    def _list(self, prefix: str, what: str) -> Iterator[dict[str, Any]]:
        """Every object under `prefix`, page by page (each page retried on its own)."""
        extra: dict[str, str] = {}
        while True:
            request = functools.partial(
                self.client.list_objects_v2,
                Bucket=self.bucket,
                Prefix=prefix,
                MaxKeys=self.page_size,
                **extra,
            )
            page = self._call(what, request, "s3:ListBucket", prefix)
            yield from page.get("Contents") or []
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            extra = {"ContinuationToken": token}

    def _read_doc(self, rel: str, **conditions: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(the document, the response without its body), None when absent; NotModified when
        `conditions` (IfNoneMatch) say the store still has that version."""
        key = self._key(rel)
        try:
            raw, response = self._get(key, f"read {rel}", limit=MAX_DOC_BYTES + 1, **conditions)
        except Missing:
            return None
        if len(raw) > MAX_DOC_BYTES:
            raise BusError(f"{self.url}/{rel} is larger than {MAX_DOC_BYTES >> 20} MiB; refusing it")
        return loads(raw, f"{self.url}/{rel}"), response

    def _same(self, key: str, data: bytes, what: str) -> bool:
        """Whether `key` holds exactly `data` (after a conditional write was refused)."""
        info = self._head(key, what)
        if info is None:  # refused by a write still in flight (409), or deleted since: try again later
            raise TransientBusError(
                f"{self.url}: {what}: another write of {self._target(key)} is in progress"
            )
        if int(info.get("ContentLength", -1)) != len(data):
            return False
        etag = str(info.get("ETag", "")).strip('"')
        if _MD5_RE.match(etag) and etag == hashlib.md5(data, usedforsecurity=False).hexdigest():
            return True
        stored, _ = self._get(key, what, limit=len(data) + 1)  # not an MD5 ETag (multipart, SSE-KMS, …)
        return stored == data

    def _put_once(self, key: str, data: bytes, what: str) -> bool:
        """Write `key` only if absent; True when it now holds `data` (written, or already identical)."""
        try:
            self._put(key, data, what, IfNoneMatch="*")
            return True
        except Conflict:
            return self._same(key, data, what)

    # -- the run --------------------------------------------------------------------------------
    def create_run(self, *, private: bool = True, gated: bool = False) -> dict[str, Any]:
        try:
            self._call(
                "check the bucket",
                lambda: self.client.head_bucket(Bucket=self.bucket),
                "s3:ListBucket",
                self._key(""),
            )
        except Missing:
            at = f" at {self.endpoint}" if self.endpoint else ""
            raise BusError(
                f"{self.url}: bucket {self.bucket!r} does not exist{at}; create it first"
            ) from None
        if self.read_manifest() is not None:
            raise BusError(f"{self.url} already holds a DiLoCo run (manifest.json); use another prefix")
        self._check_conditional_writes()
        return {"owner": None, "private": None, "gated": None}

    def _check_conditional_writes(self) -> None:
        """Refuse a store that accepts If-None-Match / If-Match and ignores them."""
        key = self._key(f".probe-{secrets.token_hex(4)}")
        self._put(key, b"", "probe write", IfNoneMatch="*")
        try:
            for header, value in (("IfNoneMatch", "*"), ("IfMatch", '"' + "0" * 32 + '"')):
                try:
                    self._put(key, b"", f"probe {header}", **{header: value})
                except Conflict:
                    continue
                except Unsupported:
                    pass
                name = "If-None-Match" if header == "IfNoneMatch" else "If-Match"
                raise BusError(
                    f"{self.url}: the store{' at ' + self.endpoint if self.endpoint else ''} does not enforce "
                    f"{name} on PUT; a DiLoCo run needs conditional writes (AWS S3, R2 and MinIO since 2024 "
                    "have them)"
                )
        finally:
            self._delete(key, "remove the probe")

    def check_master_access(self) -> None:
        self.read_manifest()
        key = self._key(f".probe-{secrets.token_hex(4)}")
        self._put(key, b"", "check the master's write access", IfNoneMatch="*")
        self._delete(key, "check the master's delete access")

    def check_worker_access(self, node: str) -> None:
        self._check_node(node)
        self.read_manifest()
        rel = f"deltas/{node}/"
        key = self._key(f"{rel}.probe-{secrets.token_hex(4)}")
        self._put(key, b"", f"check write access for {node}", IfNoneMatch="*")
        try:
            self._delete(key, f"check delete access for {node}")
        except PermissionDenied as error:  # the master removes processed deltas: not fatal
            logger.warning("%s (the probe object is left; it is never read)", error)

    def add_collaborator(
        self, user: str, node: str, delta_location: str | None, *, record_only: bool = False
    ) -> dict[str, Any]:
        if delta_location:
            raise ConfigError(f"{self.url}: deltas live under {self.url}/deltas/<node>/; drop --delta-repo")
        self._check_node(node)
        return {
            "delta_repo": None,
            "granted_read_access": None,
            "warning": (
                f"S3 has no per-user grants here: give {user} credentials (or a bucket policy) allowing "
                f"s3:GetObject and s3:ListBucket on {self.url}/*, and s3:PutObject (s3:DeleteObject too, "
                f"to prune) on {self.url}/deltas/{node}/* and {self.url}/leases/{node}.json"
            ),
        }

    # -- documents ------------------------------------------------------------------------------
    def read_manifest(self) -> dict[str, Any] | None:
        found = self._read_doc(MANIFEST)
        return None if found is None else found[0]

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self._put(self._key(MANIFEST), dumps(manifest), f"write {MANIFEST}")

    def read_head(self) -> Head | None:
        # At the ETag whose head.json was read last, a poll asks the store whether it changed
        # (If-None-Match: a 304 without a body). A waiting worker polls ~10 times a second; head.json
        # is a few KB, which was 14% of a 10 Mbit/s run's bytes on the Hub bus before its own cache.
        seen = self._head_seen
        try:
            found = self._read_doc(HEAD, **({"IfNoneMatch": seen[0]} if seen is not None else {}))
        except NotModified:
            if seen is None:  # only a conditional GET may answer 304
                raise
            return Head(copy.deepcopy(seen[1]), seen[0])  # the caller's copy: the kept one never changes
        if found is None:
            self._head_seen = None
            return None
        etag = str(found[1].get("ETag", ""))
        self._head_seen = (etag, copy.deepcopy(found[0])) if etag else None
        return Head(found[0], etag)

    def read_global(self, head: Head) -> bytes:
        return self._read_global(head, None)

    def read_global_capped(self, head: Head, max_bytes: int) -> bytes:
        data = self._read_global(head, max_bytes + 1)  # never more than one byte past the cap
        if len(data) > max_bytes:
            raise too_large(self.url, str(head.get("global", "?")), None, max_bytes)
        return data

    def read_update_capped(self, head: Head, max_bytes: int) -> bytes:
        data = self._read_global(head, max_bytes + 1, "update")
        if len(data) > max_bytes:
            raise too_large(self.url, str(head.get("update", "?")), None, max_bytes)
        return data

    def _read_global(self, head: Head, limit: int | None, key: str = "global") -> bytes:
        name = str(head.get(key) or "")
        if not (_GLOBAL_RE if key == "global" else _UPDATE_RE).match(name):
            what = "a global model file" if key == "global" else "a global update file"
            raise BusError(f"{self.url}/{HEAD} names {name!r}, not {what}")
        try:
            return self._get(self._key(name), f"download {name}", limit=limit)[0]
        except Missing:
            raise TransientBusError(
                f"{self.url}: {name} was pruned after the head naming it was read; read the head again"
            ) from None

    def publish(
        self,
        data: bytes,
        head: dict[str, Any],
        *,
        expected: Head | None = None,
        prune: Sequence[str] = (),
        update: bytes | None = None,
    ) -> Head:
        step = int(head["outer_step"])
        if expected is not None:
            if not getattr(expected, "version", ""):
                raise BusError(f"{self.url}: publish(expected=…) needs a head read from this bus")
            current = self._head(self._key(HEAD), f"check {HEAD}")
            if current is None or current.get("ETag") != expected.version:
                raise HeadMoved(
                    f"{self.url}: {HEAD} moved since it was read; another master advanced the run"
                )
        document = dict(head)
        if update is not None:  # before the head, like the global
            document["update"] = self._put_global_file("update", step, update)
        name = self._put_global_file("outer", step, data)
        document["global"] = name
        raw = dumps(document)
        condition = {"IfMatch": expected.version} if expected is not None else {"IfNoneMatch": "*"}
        try:
            response = self._put(self._key(HEAD), raw, f"write {HEAD}", **condition)
            version = str(response.get("ETag", ""))
        except (Conflict, Missing):
            found = self._read_doc(HEAD)
            if found is None or dumps(found[0]) != raw:  # not our own write answered late
                raise HeadMoved(
                    f"{self.url}: {HEAD} moved while outer step {step} was published; another master "
                    "advanced the run (nothing of this step is visible)"
                ) from None
            version = str(found[1].get("ETag", ""))
        self._prune_globals(prune, keep={name, str(document.get("update", ""))})
        return Head(document, version)

    def _put_global_file(self, prefix: str, step: int, data: bytes) -> str:
        """Store global/<prefix>_<step>.safetensors once; the key it went to."""
        name = f"global/{prefix}_{step:08d}.safetensors"
        if not self._put_once(self._key(name), data, f"write {name}"):
            # Taken by other bytes: never overwritten (a reader could pair them with the wrong head).
            name = f"global/{prefix}_{step:08d}.{secrets.token_hex(4)}.safetensors"
            if not self._put_once(self._key(name), data, f"write {name}"):
                raise BusError(f"{self.url}: could not store {name}")
        return name

    def _prune_globals(self, prune: Sequence[str], keep: set[str]) -> None:
        """Delete exactly the globals (and updates) named in `prune` (the caller's own, see
        Bus.publish), never those in `keep`; global/ is never listed, so no other key there is ever
        deleted."""
        for rel in dict.fromkeys(prune):
            if rel in keep:
                continue
            if not isinstance(rel, str) or not (_GLOBAL_RE.match(rel) or _UPDATE_RE.match(rel)):
                logger.warning("DiLoCo bus: not pruning %r (not a global/outer_<step> key)", rel)
                continue
            try:
                self._delete(self._key(rel), f"prune {rel}")
            except BusError as error:  # old globals cost storage, not correctness
                logger.warning("DiLoCo bus: pruning %s failed (%s)", rel, error)

    # -- deltas ---------------------------------------------------------------------------------
    def _check_node(self, node: str) -> None:
        if not NODE_RE.match(node):
            raise BusError(f"invalid node id {node!r}")

    def _delta_key(self, node: str, name: str) -> str:
        self._check_node(node)
        if not name or "/" in name or name in (".", "..") or not name.isprintable():
            raise BusError(f"refusing delta name {name!r}")
        return self._key(f"deltas/{node}/{name}")

    def put_delta(self, node: str, name: str, data: bytes, *, prune: list[str] = ()) -> None:
        if not DELTA_NAME_RE.match(name) or ".." in name:
            raise BusError(f"refusing delta name {name!r}")
        key = self._delta_key(node, name)
        if not self._put_once(key, data, f"upload {node}/{name}"):
            raise BusError(
                f"{self.url}: deltas/{node}/{name} already holds different bytes and a delta is written "
                f"once; is another process running as node {node!r}?"
            )
        for old in prune:
            if old == name or not DELTA_NAME_RE.match(old):
                continue
            try:
                self._delete(self._delta_key(node, old), f"prune {node}/{old}")
            except BusError as error:  # the master deletes processed deltas too
                logger.warning("DiLoCo bus: %s", error)

    def delta_exists(self, node: str, name: str) -> bool:
        return self._head(self._delta_key(node, name), f"check {node}/{name}") is not None

    def list_own_deltas(self, node: str) -> list[str]:
        self._check_node(node)
        base = self._key(f"deltas/{node}/")
        names = (item["Key"][len(base) :] for item in self._list(base, f"list deltas of {node}"))
        return sorted(n for n in names if n and "/" not in n and not n.startswith("."))

    def _skip(self, rel: str, why: str) -> None:
        if rel not in self._skipped:
            self._skipped.add(rel)
            logger.warning("DiLoCo bus: skipping deltas/%r (%s); it is never read", rel, why)

    def list_deltas(
        self, collaborators: dict[str, dict[str, Any]] | None, *, exhaustive: bool = False
    ) -> list[DeltaRef]:
        base = self._key("deltas/")
        refs: list[DeltaRef] = []
        for item in self._list(base, "list deltas"):
            key = str(item["Key"])
            rel = key[len(base) :]
            parts = rel.split("/")
            if len(parts) == 2 and (not parts[1] or parts[1].startswith(".")):
                continue  # a folder marker a console made, or a worker's access probe
            if len(parts) != 2 or not NODE_RE.match(parts[0]):
                self._skip(rel, "not deltas/<node id>/<file>")
                continue
            node, name = parts
            if not name.isprintable():
                self._skip(rel, "an unprintable name")
                continue
            if collaborators is not None and node not in collaborators:
                continue
            size = item.get("Size")
            refs.append(
                DeltaRef(node, name, None if size is None else int(size), key, str(item.get("ETag", "")))
            )
        return refs

    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes:
        key = self._delta_key(ref.node, ref.name)
        if ref.where != key:
            raise BusError(f"refusing delta reference {ref.id!r}")
        conditions: dict[str, Any] = {"IfMatch": ref.etag} if ref.etag else {}
        if ref.size is None or ref.size > max_bytes:
            conditions["Range"] = f"bytes=0-{max_bytes}"  # the decoder names the size problem
        try:
            return self._get(key, f"download {ref.id}", limit=max_bytes + 1, **conditions)[0]
        except Missing:
            raise BusError(f"{ref.id} disappeared") from None
        except Conflict:
            raise BusError(f"{ref.id} was replaced since it was listed") from None

    def delete_deltas(self, refs: list[DeltaRef]) -> None:
        """The processed deltas, in DeleteObjects requests of up to MAX_BATCH_DELETE keys, not one
        DELETE each: the master deletes them between a publish and its next poll, and N sequential
        requests, each retried on its own through a 429/500 storm, held its next round back (a soak's
        storm: 6 s for 5 deltas). A store without DeleteObjects (NotImplemented) gets one DELETE per key
        from then on. A key left undeleted is no loss: the next listing finds it processed and
        deletes it again."""
        keys: dict[str, DeltaRef] = {}
        for ref in refs:
            try:
                key = self._delta_key(ref.node, ref.name)
            except BusError as error:
                logger.warning("DiLoCo bus: cannot delete %s (%s)", ref.id, error)
                continue
            if ref.where == key:
                keys[key] = ref
        if self._batch_delete and keys:
            try:
                for start in range(0, len(keys), MAX_BATCH_DELETE):
                    self._delete_batch(list(keys)[start : start + MAX_BATCH_DELETE])
                return
            except Unsupported:
                self._batch_delete = False
                logger.info("%s: no DeleteObjects here; deleting processed deltas one by one", self.url)
            except BusError as error:
                logger.warning("DiLoCo bus: cannot delete %d processed deltas (%s)", len(keys), error)
                return
        for key, ref in keys.items():
            try:
                self._delete(key, f"delete {ref.id}")
            except BusError as error:
                logger.warning("DiLoCo bus: cannot delete %s (%s)", ref.id, error)

    def _delete_batch(self, keys: list[str]) -> None:
        """One DeleteObjects request (quiet: only failures come back); a key it could not delete is
        warned about once per request, by its key, never retried here."""
        objects = {"Objects": [{"Key": key} for key in keys], "Quiet": True}
        response = self._call(
            f"delete {len(keys)} processed deltas",
            lambda: self.client.delete_objects(Bucket=self.bucket, Delete=objects),
            "s3:DeleteObject",
            self._key("deltas/"),
        )
        errors = [e for e in response.get("Errors") or [] if isinstance(e, dict)]
        if errors:
            first = errors[0]
            logger.warning(
                "DiLoCo bus: %d of %d processed deltas not deleted (%s: %s %s); the next poll tries again",
                len(errors),
                len(keys),
                ascii(str(first.get("Key", "?"))[:200]),
                ascii(str(first.get("Code", "?"))[:60]),
                scrub(ascii(str(first.get("Message", ""))[:200])),
            )

    # -- leases ---------------------------------------------------------------------------------
    def _lease(
        self, name: str, cap_s: float = MAX_LEASE_S
    ) -> tuple[str, tuple[dict[str, Any], str, float] | None]:
        """(key, (document, ETag, seconds left by the store's clock) or None when free). A lease lasts
        at most `cap_s` (the claimer's own ttl) from its last write, whatever ttl it claims: a planted
        lease of a week locks no one out for longer than one lease."""
        if not NODE_RE.match(name):
            raise BusError(f"invalid lease name {name!r}")
        key = self._key(f"leases/{name}.json")
        try:
            raw, response = self._get(key, f"read the lease on {name}", limit=1 << 16)
        except Missing:
            return key, None
        etag = str(response.get("ETag", ""))
        try:
            document = loads(raw, key)
            ttl = min(max(float(document.get("ttl_s", 0.0)), 0.0), MAX_LEASE_S, cap_s)
        except (BusError, TypeError, ValueError):
            return key, ({"holder": "?"}, etag, 0.0)  # junk: counts as expired
        headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
        try:
            now = parsedate_to_datetime(headers["date"]).timestamp()
        except (KeyError, TypeError, ValueError):
            now = time.time()
        modified = response.get("LastModified")
        age = now - modified.timestamp() if modified is not None else 0.0
        return key, (document, etag, ttl - max(age, 0.0))

    def claim(self, name: str, holder: str, ttl_s: float) -> Claim:
        for _ in range(8):
            key, current = self._lease(name, float(ttl_s))
            continued = False
            if current is None:
                condition = {"IfNoneMatch": "*"}
            else:
                document, etag, left = current
                other = str(document.get("holder", "?"))[:200]
                if other != holder and left > 0:
                    raise ClaimHeld(
                        f"{self.url}: {name!r} is held by {other!r} for another {left:.0f}s (a node id in "
                        "use elsewhere, or a second master); wait for it or pick another",
                        holder=other,
                        expires_in=left,
                    )
                condition = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
                continued = other == holder
            now = time.time()
            document = {"name": name, "holder": holder, "ttl_s": float(ttl_s), "expires_at": now + ttl_s}
            try:
                response = self._put(key, dumps(document), f"claim {name}", **condition)
            except (Conflict, Missing):
                continue  # written or removed by someone else meanwhile (or by our own lost answer)
            return Claim(name, holder, now + ttl_s, str(response.get("ETag", "")), continued)
        raise TransientBusError(f"{self.url}: the lease on {name!r} keeps changing; try again")

    def lease_left(self, name: str) -> float | None:
        _, current = self._lease(name)
        return None if current is None else max(0.0, current[2])

    def release(self, claim: Claim) -> None:
        key, current = self._lease(claim.name)
        if current is None or str(current[0].get("holder")) != claim.holder:
            return  # expired and taken over, or gone: not ours to remove
        if self._conditional_delete:
            try:
                self._delete(key, f"release {claim.name}", IfMatch=current[1])
                return
            except Conflict:
                return  # renewed or taken over since we looked
            except Unsupported:
                self._conditional_delete = False
                logger.info("%s: no conditional delete here; releasing after a re-check", self.url)
        self._delete(key, f"release {claim.name}")  # the holder was checked just above

    # -- upkeep ---------------------------------------------------------------------------------
    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
