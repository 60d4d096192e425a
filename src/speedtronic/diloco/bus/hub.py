"""The Hugging Face Hub bus: a run repo (manifest, head, global model) plus per-collaborator delta repos.

Who may write where (the Hub has no API to give another user write access to a user-owned repo,
and a repo takes ~128 commits/hour):
- the run repo `owner/name` is written by its owner (the master): manifest.json, head.json and
  global/model.safetensors, all in one commit per outer step so readers never see a torn pair;
- each collaborator writes deltas into a repo it owns (default `<user>/<name>-deltas`, created on
  first use), so the Hub guarantees authorship and each writer has its own commit budget; an
  organisation's run can instead list the run repo itself as members' delta repo;
- a worker deletes its own processed deltas in the commit of its next upload (the master cannot
  write into other users' repos); the master deletes what it may and squashes the run repo's history.

Reads go by commit sha (`repo_info` first, then download at that sha): a cached file is never
mistaken for the current one while the server is down. Every call has a timeout (an httpx client
factory), and transient failures (5xx, 408, 429 with its Retry-After, timeouts, refused connections)
are retried with exponential backoff; permission errors fail at once. Tokens never reach a message.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from speedtronic.diloco.bus.base import (
    HEAD,
    Bus,
    BusError,
    DeltaRef,
    PermissionDenied,
    TransientBusError,
    dumps,
    loads,
)
from speedtronic.secrets import scrub

logger = logging.getLogger("speedtronic.diloco")
T = TypeVar("T")
GLOBAL_PATH = "global/model.safetensors"
_TIMEOUT_INSTALLED: list[float] = []


class NotFound(BusError):
    pass


def install_timeout(seconds: float) -> None:
    """Give every huggingface_hub request a timeout. Most of its calls pass `timeout=None`, which
    overrides a client default, so the limit is enforced in the transport instead."""
    if _TIMEOUT_INSTALLED and _TIMEOUT_INSTALLED[0] == seconds:
        return
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils._http import hf_request_event_hook

    class DeadlineTransport(httpx2.HTTPTransport):
        def handle_request(self, request: Any) -> Any:
            given = request.extensions.get("timeout") or {}
            limits = {
                k: given.get(k) if given.get(k) is not None else seconds
                for k in ("connect", "read", "write", "pool")
            }
            request.extensions = {**request.extensions, "timeout": limits}
            return super().handle_request(request)

    def factory() -> Any:
        return httpx2.Client(
            transport=DeadlineTransport(),
            event_hooks={"request": [hf_request_event_hook]},
            follow_redirects=True,
            timeout=seconds,
        )

    set_client_factory(factory)
    _TIMEOUT_INSTALLED[:] = [seconds]


def default_delta_repo(run_repo: str, user: str) -> str:
    return f"{user}/{run_repo.split('/', 1)[1]}-deltas"


def classify(error: BaseException, what: str) -> BusError:
    """Map a huggingface_hub/httpx failure to NotFound, PermissionDenied or TransientBusError."""
    import httpx2
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(error, LocalEntryNotFoundError) and error.__cause__ is not None:
        error = error.__cause__
    text = scrub(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")[:200]
    if isinstance(error, (EntryNotFoundError, RevisionNotFoundError)):
        return NotFound(f"{what}: not found")
    if isinstance(error, RepositoryNotFoundError):
        return PermissionDenied(f"{what}: missing read permission, or the repo does not exist ({text})")
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        if status in (401, 403):
            return PermissionDenied(f"{what}: missing permission (HTTP {status}: {text})")
        if status == 404:
            return NotFound(f"{what}: not found")
        if status in (408, 409, 412, 429) or status >= 500:
            transient = TransientBusError(f"{what}: HTTP {status} ({text})")
            retry_after = error.response.headers.get("Retry-After")
            if status == 429 and retry_after:
                with contextlib.suppress(ValueError):
                    transient.retry_after = float(retry_after)  # type: ignore[attr-defined]
            return transient
        return BusError(f"{what}: HTTP {status} ({text})")
    if isinstance(error, (httpx2.TransportError, OSError, TimeoutError)):
        return TransientBusError(f"{what}: {text}")
    return BusError(f"{what}: {text}")


class HubBus(Bus):
    def __init__(
        self, repo_id: str, *, config: Any = None, endpoint: str | None = None, token: str | None = None
    ) -> None:
        import os

        from huggingface_hub import HfApi

        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise BusError(f"REPO must be owner/name or file://PATH, not {repo_id!r}")
        self.repo_id = repo_id
        self.endpoint = (
            endpoint
            or (config.endpoint if config is not None else None)
            or os.environ.get("HF_ENDPOINT")
            or "https://huggingface.co"
        ).rstrip("/")
        self.url = f"{self.endpoint}/{repo_id}"
        if token is None and config is not None and config.token is not None:
            token = config.token.get_secret_value()
        if token is None:
            from speedtronic.secrets import env_token, stored_login_token

            token = env_token() or stored_login_token()
        self.token = token
        self.retry_initial = config.retry_initial if config is not None else 1.0
        self.retry_max = config.retry_max if config is not None else 60.0
        self.retry_attempts = config.retry_attempts if config is not None else 8
        self.cache_dir = config.cache_dir if config is not None else None
        install_timeout(config.request_timeout if config is not None else 60.0)
        self.api = HfApi(endpoint=self.endpoint, token=token)
        self._collaborators: dict[str, dict[str, Any]] = {}

    # -- plumbing -------------------------------------------------------------------------------
    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient failures with exponential backoff (and 429's Retry-After)."""
        delay = self.retry_initial
        for attempt in range(self.retry_attempts + 1):
            try:
                return fn()
            except BusError:
                raise
            except Exception as error:
                failure = classify(error, what)
                if not isinstance(failure, TransientBusError) or attempt == self.retry_attempts:
                    raise failure from None
                # A 429's Retry-After is the server's word and is honoured as given (up to an hour).
                retry_after = getattr(failure, "retry_after", None)
                wait = (
                    min(retry_after, 3600.0)
                    if retry_after
                    else min(delay * (1 + 0.25 * random.random()), self.retry_max)
                )
                logger.warning(
                    "%s; retrying in %.1fs (%d/%d)", failure, wait, attempt + 1, self.retry_attempts
                )
                time.sleep(wait)
                delay = min(delay * 2, self.retry_max)
        raise AssertionError("unreachable")

    def sha(self, repo: str | None = None) -> str:
        repo = repo or self.repo_id
        info = self.call(f"{repo}: read", lambda: self.api.repo_info(repo))
        return info.sha  # type: ignore[return-value]

    def _download(self, repo: str, path: str, revision: str) -> bytes:
        if self.cache_dir:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
        cache = tempfile.mkdtemp(prefix="speedtronic-hub-", dir=self.cache_dir)
        try:
            local = self.call(
                f"{repo}: download {path}",
                lambda: self.api.hf_hub_download(repo, path, revision=revision, cache_dir=cache),
            )
            return Path(local).read_bytes()
        finally:
            shutil.rmtree(cache, ignore_errors=True)

    def _commit(self, repo: str, operations: list[Any], message: str) -> None:
        self.call(
            f"{repo}: write ({message})",
            lambda: self.api.create_commit(repo, operations, commit_message=message),
        )

    # -- documents ------------------------------------------------------------------------------
    def read_json(self, path: str) -> dict[str, Any] | None:
        sha = self.sha()
        try:
            raw = self._download(self.repo_id, path, sha)
        except NotFound:
            return None
        data = loads(raw, f"{self.repo_id}/{path}")
        if path == HEAD:
            data["_revision"] = sha
        return data

    def write_json(self, path: str, data: dict[str, Any]) -> None:
        from huggingface_hub import CommitOperationAdd

        self._commit(self.repo_id, [CommitOperationAdd(path, dumps(data))], f"update {path}")

    def read_file(self, path: str, revision: str | None = None) -> bytes:
        return self._download(self.repo_id, path, revision or self.sha())

    def publish_global(self, data: bytes, head: dict[str, Any]) -> None:
        from huggingface_hub import CommitOperationAdd

        head = {k: v for k, v in head.items() if not k.startswith("_")}
        ops = [
            CommitOperationAdd(GLOBAL_PATH, data),
            CommitOperationAdd(HEAD, dumps({**head, "global": GLOBAL_PATH})),
        ]
        self._commit(self.repo_id, ops, f"outer step {head['outer_step']}")

    def compact(self) -> None:
        self.call(f"{self.repo_id}: squash history", lambda: self.api.super_squash_history(self.repo_id))

    # -- deltas ---------------------------------------------------------------------------------
    def collaborators(self) -> dict[str, dict[str, Any]]:
        if not self._collaborators:
            manifest = self.read_manifest() or {}
            self._collaborators = dict(manifest.get("collaborators") or {})
        return self._collaborators

    def delta_repo(self, node: str) -> str:
        entry = self.collaborators().get(node)
        if entry is None:
            raise PermissionDenied(
                f"{self.repo_id}: node {node!r} is not a collaborator of this run; the owner adds it with "
                f"`speedtronic hub add-collaborator {self.repo_id} {node}`"
            )
        return str(entry.get("delta_repo") or default_delta_repo(self.repo_id, entry.get("user", node)))

    def put_delta(self, node: str, name: str, data: bytes, *, prune: list[str] = ()) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        repo = self.delta_repo(node)
        ops: list[Any] = [CommitOperationAdd(f"deltas/{node}/{name}", data)]
        if repo != self.repo_id:  # in the shared run repo the master deletes processed deltas itself
            ops += [CommitOperationDelete(f"deltas/{node}/{old}") for old in prune]
        self._commit(repo, ops, f"delta {name}")

    def delta_exists(self, node: str, name: str) -> bool:
        repo = self.delta_repo(node)
        return bool(
            self.call(f"{repo}: check {name}", lambda: self.api.file_exists(repo, f"deltas/{node}/{name}"))
        )

    def _tree(self, repo: str) -> list[Any]:
        try:
            sha = self.sha(repo)
            return list(
                self.call(
                    f"{repo}: list deltas",
                    lambda: list(self.api.list_repo_tree(repo, "deltas", recursive=True, revision=sha)),
                )
            )
        except NotFound:
            return []

    def list_own_deltas(self, node: str) -> list[str]:
        prefix = f"deltas/{node}/"
        return sorted(
            e.path[len(prefix) :]
            for e in self._tree(self.delta_repo(node))
            if e.path.startswith(prefix) and hasattr(e, "size")
        )

    def list_deltas(self, collaborators: dict[str, dict[str, Any]] | None) -> list[DeltaRef]:
        listed = collaborators if collaborators is not None else self.collaborators()
        by_repo: dict[str, list[str]] = {}
        for node in listed:
            try:
                by_repo.setdefault(self.delta_repo(node), []).append(node)
            except PermissionDenied as error:  # listed in the config but not in the manifest
                logger.warning("%s", error)
        refs: list[DeltaRef] = []
        for repo, nodes in by_repo.items():
            try:
                entries = self._tree(repo)
            except PermissionDenied as error:
                logger.warning("cannot list deltas of %s: %s", ",".join(nodes), error)
                continue
            for entry in entries:
                if not hasattr(entry, "size") or not entry.path.startswith("deltas/"):
                    continue  # folders
                parts = entry.path.split("/")
                if repo == self.repo_id or len(nodes) > 1:
                    node = parts[1] if len(parts) == 3 else "?"  # a shared repo: the folder names the node
                else:
                    node = nodes[0]  # a collaborator's own repo: the Hub vouches for the author
                refs.append(
                    DeltaRef(node, "/".join(parts[2:]) or entry.path, entry.size, f"{repo}:{entry.path}")
                )
        return refs

    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes:
        repo, path = ref.where.split(":", 1)
        if ref.size is not None and ref.size > max_bytes:
            return b"\0" * (max_bytes + 1)  # never downloaded; the decoder names the size problem
        return self._download(repo, path, self.sha(repo))

    def delete_deltas(self, refs: list[DeltaRef]) -> None:
        from huggingface_hub import CommitOperationDelete

        mine = [r for r in refs if r.where.split(":", 1)[0] == self.repo_id]
        if mine:
            ops = [CommitOperationDelete(r.where.split(":", 1)[1]) for r in mine]
            self._commit(self.repo_id, ops, f"remove {len(ops)} processed deltas")

    # -- access ---------------------------------------------------------------------------------
    def whoami(self) -> dict[str, Any]:
        return self.call(f"{self.endpoint}: whoami", lambda: self.api.whoami())

    def check_worker_access(self, node: str) -> None:
        self.sha()  # PermissionDenied names the run repo when it cannot be read
        repo = self.delta_repo(node)
        me = self.whoami()
        user = me.get("name", "?")
        role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
        writable = {user} | {
            o.get("name") for o in me.get("orgs") or [] if o.get("roleInOrg") not in (None, "read")
        }
        if role == "read":
            raise PermissionDenied(f"{repo}: missing write permission (the token is read-only)")
        owner = repo.split("/", 1)[0]
        if owner not in writable:
            raise PermissionDenied(
                f"{repo}: missing write permission ({user} can write only to its own repos and orgs "
                f"where it has a write role)"
            )
        try:
            self.sha(repo)
        except PermissionDenied:
            if repo == self.repo_id:
                raise
            self.create_delta_repo(repo)

    def create_delta_repo(self, repo: str) -> None:
        """A collaborator's own delta repo: gated (not listed for everyone), read access granted to the
        run's owner so its master can fetch the deltas; only the collaborator can write to it."""
        owner = (self.collaborators().get("master") or {}).get("user") or self.repo_id.split("/")[0]
        self.call(f"{repo}: create", lambda: self.api.create_repo(repo, private=False, exist_ok=True))
        self.call(f"{repo}: gate", lambda: self.api.update_repo_settings(repo, gated="manual"))
        if owner != repo.split("/")[0]:
            self.call(f"{repo}: grant {owner} read access", lambda: self.api.grant_access(repo, owner))
        logger.info("created delta repo %s (gated; read access for %s)", repo, owner)
