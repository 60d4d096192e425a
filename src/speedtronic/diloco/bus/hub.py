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
mistaken for the current one while the server is down. Timeouts, retries of transient failures and
secret-free errors come from the shared client in speedtronic/hub_client.py.
"""

from __future__ import annotations

import logging
from typing import Any

from speedtronic.diloco.bus.base import (
    HEAD,
    Bus,
    BusError,
    DeltaRef,
    PermissionDenied,
    dumps,
    loads,
)
from speedtronic.hub_client import HubClient, NotFound

logger = logging.getLogger("speedtronic.diloco")
GLOBAL_PATH = "global/model.safetensors"


def default_delta_repo(run_repo: str, user: str) -> str:
    return f"{user}/{run_repo.split('/', 1)[1]}-deltas"


class HubBus(HubClient, Bus):
    def __init__(
        self, repo_id: str, *, config: Any = None, endpoint: str | None = None, token: str | None = None
    ) -> None:
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise BusError(f"REPO must be owner/name or file://PATH, not {repo_id!r}")
        if token is None and config is not None and config.token is not None:
            token = config.token.get_secret_value()
        settings: dict[str, Any] = {}
        if config is not None:
            settings = {
                "retry_initial": config.retry_initial,
                "retry_max": config.retry_max,
                "retry_attempts": config.retry_attempts,
                "request_timeout": config.request_timeout,
                "cache_dir": config.cache_dir,
            }
        super().__init__(
            endpoint=endpoint or (config.endpoint if config is not None else None), token=token, **settings
        )
        self.repo_id = repo_id
        self.url = f"{self.endpoint}/{repo_id}"
        self._collaborators: dict[str, dict[str, Any]] = {}

    def sha(self, repo: str | None = None) -> str:
        return super().sha(repo or self.repo_id)

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
                lfs = getattr(entry, "lfs", None)
                etag = str(getattr(lfs, "sha256", None) or getattr(entry, "blob_id", "") or "")
                name = "/".join(parts[2:]) or entry.path
                refs.append(DeltaRef(node, name, entry.size, f"{repo}:{entry.path}", etag))
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
