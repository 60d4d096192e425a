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
mistaken for the current one while the server is down.

The request budget: every delta repo (and the run repo) carries the run's tag (`run_tag`, in the
README's model-card metadata, written when the repo is created or first used by a worker). One
`list_models(filter=tag, expand=sha)` call per poll returns every tagged repo's head commit; only
repos whose head moved since the last poll have their tree listed again (at that sha), and deltas
are downloaded at that sha. A poll therefore costs one listing request (one per 1,000 repos, the
Hub's page size) plus one per repo that changed, whatever the number of collaborators. Repos the
listing does not show (not created yet, untagged, private to someone else) are checked directly,
at most `UNLISTED_PER_POLL` of them per poll in turn. The master's poll interval then stretches so
polls use at most half the token's request budget (`poll_delay`). Timeouts, retries of transient failures and
secret-free errors come from the shared client in speedtronic/hub_client.py.
"""

from __future__ import annotations

import hashlib
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
README = "README.md"
UNLISTED_PER_POLL = 2


def default_delta_repo(run_repo: str, user: str) -> str:
    return f"{user}/{run_repo.split('/', 1)[1]}-deltas"


def run_tag(run_repo: str) -> str:
    """The tag every repo of a run carries: one listing call finds them all."""
    return "speedtronic-diloco-" + hashlib.sha256(run_repo.encode()).hexdigest()[:16]


def tagged_readme(run_repo: str, what: str) -> bytes:
    return (
        f"---\ntags:\n- speedtronic-diloco\n- {run_tag(run_repo)}\n---\n\n{what} of the speedtronic "
        f"DiLoCo run {run_repo}.\n"
    ).encode()


class HubBus(HubClient, Bus):
    def __init__(
        self,
        repo_id: str,
        *,
        config: Any = None,
        endpoint: str | None = None,
        token: str | None = None,
        **overrides: Any,
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
                "request_budget": config.hub_request_budget,
                "request_window": config.hub_request_window,
                "commit_budget": config.hub_commit_budget,
                "commit_window": config.hub_commit_window,
            }
        settings.update(overrides)
        super().__init__(
            endpoint=endpoint or (config.endpoint if config is not None else None), token=token, **settings
        )
        self.repo_id = repo_id
        self.url = f"{self.endpoint}/{repo_id}"
        self._collaborators: dict[str, dict[str, Any]] = {}
        self._trees: dict[str, tuple[str, list[Any]]] = {}  # repo -> (sha, delta entries at that sha)
        self._unlisted_turn = 0
        self.unlisted_per_poll = UNLISTED_PER_POLL
        self.polls = 0
        self.poll_requests = 0  # requests spent listing deltas, over all polls

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

    def _listed_heads(self) -> dict[str, str]:
        """{repo: head sha} of every repo carrying the run's tag, in one listing call per 1,000 repos."""
        tag = run_tag(self.repo_id)
        models = self.call(
            f"{self.endpoint}: list the run's repos",
            lambda: list(self.api.list_models(filter=tag, expand=["sha", "lastModified"])),
        )
        return {m.id: m.sha for m in models if m.sha}

    def _entries(self, repo: str, sha: str) -> list[Any]:
        cached = self._trees.get(repo)
        if cached is not None and cached[0] == sha:
            return cached[1]
        try:
            entries = list(
                self.call(
                    f"{repo}: list deltas",
                    lambda: list(self.api.list_repo_tree(repo, "deltas", recursive=True, revision=sha)),
                )
            )
        except NotFound:
            entries = []
        entries = [e for e in entries if hasattr(e, "size") and e.path.startswith("deltas/")]
        self._trees[repo] = (sha, entries)
        return entries

    def list_deltas(self, collaborators: dict[str, dict[str, Any]] | None) -> list[DeltaRef]:
        listed = collaborators if collaborators is not None else self.collaborators()
        by_repo: dict[str, list[str]] = {}
        for node in listed:
            try:
                by_repo.setdefault(self.delta_repo(node), []).append(node)
            except PermissionDenied as error:  # listed in the config but not in the manifest
                logger.warning("%s", error)
        before = self.requests.taken
        heads = self._listed_heads()
        unlisted = sorted(r for r in by_repo if r not in heads)
        if unlisted:  # checked directly, a few per poll in turn, so the cost stays flat
            start = self._unlisted_turn % len(unlisted)
            for repo in (unlisted + unlisted)[start : start + min(self.unlisted_per_poll, len(unlisted))]:
                try:
                    heads[repo] = self.sha(repo)
                except (NotFound, PermissionDenied):
                    self._trees.pop(repo, None)
            self._unlisted_turn += self.unlisted_per_poll
        refs: list[DeltaRef] = []
        for repo, nodes in by_repo.items():
            sha = heads.get(repo)
            try:
                entries = self._entries(repo, sha) if sha else self._trees.get(repo, ("", []))[1]
            except PermissionDenied as error:
                logger.warning("cannot list deltas of %s: %s", ",".join(nodes), error)
                continue
            for entry in entries:
                parts = entry.path.split("/")
                if repo == self.repo_id or len(nodes) > 1:
                    node = parts[1] if len(parts) == 3 else "?"  # a shared repo: the folder names the node
                else:
                    node = nodes[0]  # a collaborator's own repo: the Hub vouches for the author
                lfs = getattr(entry, "lfs", None)
                etag = str(getattr(lfs, "sha256", None) or getattr(entry, "blob_id", "") or "")
                name = "/".join(parts[2:]) or entry.path
                refs.append(DeltaRef(node, name, entry.size, f"{repo}:{entry.path}", etag))
        self.polls += 1
        self.poll_requests += self.requests.taken - before
        return refs

    def get_delta(self, ref: DeltaRef, max_bytes: int) -> bytes:
        repo, path = ref.where.split(":", 1)
        if ref.size is not None and ref.size > max_bytes:
            return b"\0" * (max_bytes + 1)  # never downloaded; the decoder names the size problem
        sha = self._trees[repo][0] if repo in self._trees else self.sha(repo)
        return self._download(repo, path, sha)

    def poll_delay(self, interval: float, cost: float) -> float:
        """Polls may spend at most half the request budget (the rest downloads deltas, publishes and
        trains); the next poll also waits until the run repo may take another commit."""
        budget = self.requests
        fair = max(1.0, cost) / (0.5 * budget.rate)
        return max(interval, fair, budget.wait_s(cost), self.commit_bucket(self.repo_id).wait_s())

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
            return
        if repo != self.repo_id:
            self.ensure_tagged(repo, f"Deltas of node {node}")

    def ensure_tagged(self, repo: str, what: str) -> None:
        """Give `repo` the run's tag (so the master's one listing call sees it) unless it has it."""
        from huggingface_hub import CommitOperationAdd

        owner = repo.split("/", 1)[0]
        tag = run_tag(self.repo_id)
        found = self.call(
            f"{repo}: check the run tag", lambda: list(self.api.list_models(filter=tag, author=owner))
        )
        if any(m.id == repo for m in found):
            return
        self._commit(repo, [CommitOperationAdd(README, tagged_readme(self.repo_id, what))], "tag the run")

    def create_delta_repo(self, repo: str) -> None:
        """A collaborator's own delta repo: gated (not listed for everyone), read access granted to the
        run's owner so its master can fetch the deltas; only the collaborator can write to it."""
        owner = (self.collaborators().get("master") or {}).get("user") or self.repo_id.split("/")[0]
        from huggingface_hub import CommitOperationAdd

        self.call(f"{repo}: create", lambda: self.api.create_repo(repo, private=False, exist_ok=True))
        self._commit(repo, [CommitOperationAdd(README, tagged_readme(self.repo_id, "Deltas"))], "tag the run")
        self.call(f"{repo}: gate", lambda: self.api.update_repo_settings(repo, gated="manual"))
        if owner != repo.split("/")[0]:
            self.call(f"{repo}: grant {owner} read access", lambda: self.api.grant_access(repo, owner))
        logger.info("created delta repo %s (gated; read access for %s)", repo, owner)
