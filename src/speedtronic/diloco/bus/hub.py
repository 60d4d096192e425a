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
mistaken for the current one while the server is down. A Head's version is the run repo's commit
sha it was read at (or that `publish` created); `read_global(head)` downloads at that sha.

What `publish(..., expected=head)` guarantees: the Hub's `create_commit(parent_commit=sha)` is a
compare-and-swap on the repo's head commit (412 when another commit came first). The bus reads the
current sha; when it is not `expected.version` (the manifest, processed deltas or a squash moved it)
it compares head.json at that sha with `expected`'s content and raises HeadMoved when another master
published since; then it commits global and head together with `parent_commit` = that sha, and on a
412 looks again. So two masters can never both advance from one head; a publish whose answer was
lost but which landed is recognised by its content (head.json and the global's bytes), not mistaken
for another master's. It costs one repo_info per publish, plus a download of head.json when
something else committed in between.

Leases: `leases/<name>.json` ({holder, expires_at}) in the node's own delta repo (the run repo for
"master"), read at the current sha and committed with `parent_commit`, so two claimers race through
the same compare-and-swap and exactly one wins. Each claim or renewal, and each release, costs one
commit from that repo's budget (~128 per hour) and about five requests: renew a lease every few
minutes, not every poll.

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

import contextlib
import hashlib
import logging
import math
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from speedtronic.diloco.bus.base import (
    HEAD,
    MANIFEST,
    Bus,
    BusError,
    Claim,
    ClaimHeld,
    DeltaRef,
    Head,
    HeadMoved,
    PermissionDenied,
    TransientBusError,
    dumps,
    loads,
    shown_name,
    too_large,
)
from speedtronic.errors import ConfigError
from speedtronic.hub_client import HubClient, NotFound, Stale, TooLarge

if TYPE_CHECKING:
    from speedtronic.config.distributed import BusConfig

# The Hub's repo ids: owner/name, each a letter or digit then letters, digits, '.', '_' or '-'.
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

logger = logging.getLogger("speedtronic.diloco")
GLOBAL_PATH = "global/model.safetensors"
UPDATE_PATH = "global/update.safetensors"  # the global's update from the one before (global_update.py)
README = "README.md"
UNLISTED_PER_POLL = 2
TREE_THREADS = 8  # delta repos listed side by side when several moved since the last poll
CAS_ATTEMPTS = 8  # compare-and-swap commits tried before giving up (each lost race re-reads first)


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
    scheme = "hub"
    supports_updates = True
    master_lease_s = 600.0  # each renewal is a run-repo commit: 18 an hour of the ~128

    def __init__(
        self,
        repo_id: str,
        *,
        config: BusConfig | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        **overrides: Any,
    ) -> None:
        if not REPO_ID_RE.match(repo_id):
            raise ConfigError(
                f"--repo: REPO must be owner/name (the Hub: letters, digits, '.', '_', '-'), file://PATH or "
                f"s3://BUCKET/PREFIX, not {repo_id!r}"
            )
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
        self._unclaimed: set[str] = set()  # the run's tagged repos no listed node owns (latest listing)
        self.unlisted_per_poll = UNLISTED_PER_POLL  # a status check (exhaustive) looks at them all
        self.polls = 0
        self.poll_requests = 0  # requests spent listing deltas, over all polls
        self._unprintable: set[str] = set()  # delta paths with control characters, logged once
        self._head_seen: tuple[str, bytes] | None = None  # (commit, head.json's bytes there)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        config: BusConfig | None = None,
        endpoint: str | None = None,
        token: str | None = None,
        **settings: Any,
    ) -> HubBus:
        """`owner/name` or `hf://owner/name`."""
        repo = url.split("://", 1)[1] if url.lower().startswith("hf://") else url
        return cls(repo, config=config, endpoint=endpoint, token=token, **settings)

    def sha(self, repo: str | None = None) -> str:
        return super().sha(repo or self.repo_id)

    # -- the run --------------------------------------------------------------------------------
    def create_run(self, *, private: bool = True, gated: bool = False) -> dict[str, Any]:
        """The run repo, tagged for the one listing. Gated (what `hub init` asks for unless told
        otherwise): public behind a manual access gate, so `add_collaborator` can grant a user read
        access; private: readable only by the owner (and an organisation's members); neither: public."""
        user = self.whoami().get("name") or self.repo_id.split("/")[0]
        private = private and not gated
        repo = self.repo_id
        self.call(f"{repo}: create", lambda: self.api.create_repo(repo, private=private, exist_ok=True))
        if gated:
            self.call(f"{repo}: gate", lambda: self.api.update_repo_settings(repo, gated="manual"))
        self.ensure_tagged(repo, "The run repo")
        # The master node's delta location is the run repo itself (a master that trains keeps them
        # local instead: bus/local_deltas.py).
        return {"owner": user, "private": private, "gated": gated, "delta_repo": repo}

    def check_master_access(self) -> None:
        self.sha()  # PermissionDenied names the run repo when it cannot be read
        self._check_writable(self.repo_id)
        self.ensure_tagged(self.repo_id, "The run repo")  # runs created before tags: one listing finds it

    def add_collaborator(
        self, user: str, node: str, delta_location: str | None, *, record_only: bool = False
    ) -> dict[str, Any]:
        """Their delta repo (default `<user>/<run name>-deltas`, theirs), and read access to the run:
        granted when the run repo is gated. A private, ungated run repo is readable only by its owner
        and, for an organisation's repo, its members: for anyone else this refuses (ConfigError, exit 2)
        naming what to do, unless `record_only` (then the caller gets a warning to show)."""
        repo = self.repo_id
        owner = repo.split("/", 1)[0]
        info = self.call(f"{repo}: read", lambda: self.api.repo_info(repo))
        granted, readable, warning = False, True, None
        private = bool(getattr(info, "private", False))
        if getattr(info, "gated", False) and not private:
            self.call(f"{repo}: grant access to {user}", lambda: self.api.grant_access(repo, user))
            granted = True
        elif private and user != owner and not self._org_member(owner, user):  # a grant would not help
            readable = False
            gate = getattr(info, "gated", False)
            state = "private (a gate does not open a private repo)" if gate else "private and not gated"
            why = (
                f"{repo} is {state}, so {user} cannot read the run (their worker would get HTTP 401): make it "
                f"public behind a gate (the repo's Settings: visibility public, Access requests → manual "
                f"review; or a new run with `speedtronic hub init REPO CONFIG`, gated by default) and run "
                f"add-collaborator again to grant access, or add {user} to the {owner} organisation"
            )
            if not record_only:
                raise ConfigError(f"{why}; or pass --record-only to list them anyway")
            warning = why
        return {
            "delta_repo": delta_location or default_delta_repo(repo, user),
            "granted_read_access": granted,
            "readable": readable,
            "warning": warning,
        }

    def _org_member(self, org: str, user: str) -> bool:
        """Whether `user` belongs to organisation `org` (False for a user namespace, or when the Hub
        does not say)."""
        if org == self.whoami().get("name"):
            return False  # the owner's own namespace is a user, not an organisation
        try:
            members = self.call(f"{org}: list members", lambda: list(self.api.list_organization_members(org)))
        except (NotFound, PermissionDenied):
            return False
        return any(getattr(m, "username", None) == user for m in members)

    # -- documents ------------------------------------------------------------------------------
    def _doc_at(self, path: str, sha: str) -> dict[str, Any] | None:
        try:
            raw = self._download(self.repo_id, path, sha)
        except NotFound:
            return None
        return loads(raw, f"{self.repo_id}/{path}")

    def read_manifest(self) -> dict[str, Any] | None:
        manifest = self._doc_at(MANIFEST, self.sha())
        if manifest is not None and isinstance(manifest.get("collaborators"), dict):
            # A re-read (the master's membership refresh) also updates where deltas are listed, so a
            # collaborator added since is found in its own delta repo.
            self._collaborators = dict(manifest["collaborators"])
        return manifest

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        from huggingface_hub import CommitOperationAdd

        self._commit(self.repo_id, [CommitOperationAdd(MANIFEST, dumps(manifest))], f"update {MANIFEST}")
        self._collaborators = {}

    def read_head(self) -> Head | None:
        # A commit's files never change: while the repo stays at the commit whose head.json was read
        # last, a poll costs the one request that tells the commit (a waiting worker polls ~10 times a
        # second; head.json is a few KB, and two more requests, each time).
        sha = self.sha()
        if self._head_seen is not None and self._head_seen[0] == sha:
            return Head(loads(self._head_seen[1], f"{self.repo_id}/{HEAD}"), sha)
        try:
            raw = self._download(self.repo_id, HEAD, sha)
        except NotFound:
            return None
        document = loads(raw, f"{self.repo_id}/{HEAD}")  # raises on junk: nothing is remembered
        self._head_seen = (sha, raw)
        return Head(document, sha)

    def read_global(self, head: Head) -> bytes:
        return self._download(
            self.repo_id, str(head.get("global") or GLOBAL_PATH), head.version or self.sha()
        )

    def read_global_capped(self, head: Head, max_bytes: int) -> bytes:
        path = str(head.get("global") or GLOBAL_PATH)
        try:  # the file's size is read from disk before its bytes: never a buffer past the cap
            return self._download(self.repo_id, path, head.version or self.sha(), max_bytes=max_bytes)
        except TooLarge as error:
            raise too_large(self.url, path, error.size, max_bytes) from None

    def read_update_capped(self, head: Head, max_bytes: int) -> bytes:
        if head.get("update") != UPDATE_PATH:
            raise BusError(
                f"{self.url}: head.json names the update {str(head.get('update'))[:80]!r}, not {UPDATE_PATH}"
            )
        try:
            return self._download(self.repo_id, UPDATE_PATH, head.version or self.sha(), max_bytes=max_bytes)
        except TooLarge as error:
            raise too_large(self.url, UPDATE_PATH, error.size, max_bytes) from None

    def publish(
        self,
        data: bytes,
        head: dict[str, Any],
        *,
        expected: Head | None = None,
        prune: Sequence[str] = (),
        update: bytes | None = None,
    ) -> Head:
        # `prune` has nothing to do here: every step overwrites the one GLOBAL_PATH (the global the
        # new head names) and UPDATE_PATH, and older versions live only in history, which `compact`
        # squashes.
        from huggingface_hub import CommitOperationAdd

        named = {"global": GLOBAL_PATH, **({"update": UPDATE_PATH} if update is not None else {})}
        document = loads(dumps({**head, **named}), HEAD)  # as a reader will see it
        step = head["outer_step"]
        for _ in range(CAS_ATTEMPTS):
            parent = None
            if expected is not None:
                parent = self.sha()
                if parent != expected.version:
                    current = self._doc_at(HEAD, parent)
                    if current == document and self._download(self.repo_id, GLOBAL_PATH, parent) == data:
                        return Head(current, parent)  # our own commit landed but its answer was lost
                    if current is None or current != dict(expected):
                        raise HeadMoved(
                            f"{self.repo_id}: head.json moved to outer step "
                            f"{None if current is None else current.get('outer_step')} since this master "
                            f"read outer step {expected.get('outer_step')}"
                        )
            ops = [CommitOperationAdd(GLOBAL_PATH, data), CommitOperationAdd(HEAD, dumps(document))]
            if update is not None:  # the same commit: a head never names an update of another step
                ops.insert(0, CommitOperationAdd(UPDATE_PATH, update))
            try:
                info = self._commit(self.repo_id, ops, f"outer step {step}", parent_commit=parent)
            except Stale:
                continue  # someone committed between the check and the commit: look again
            return Head(document, getattr(info, "oid", None) or self.sha())
        raise TransientBusError(f"{self.repo_id}: the run repo kept moving; outer step {step} not published")

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

    def _prefetch_trees(self, repos: list[tuple[str, str]]) -> None:
        """List side by side the delta repos that moved since the last poll. A round's deltas land
        together, one commit per node: listed one after another, four repos took 0.135 s of a 1.6-s
        round at 10 Mbit/s (bench/wan.py, a timeline with ms stamps). A listing that fails is left to
        `_entries` in the caller's loop, which asks again and says why."""
        moved = [(repo, sha) for repo, sha in repos if self._trees.get(repo, ("", []))[0] != sha]
        if len(moved) < 2:
            return
        with ThreadPoolExecutor(max_workers=min(TREE_THREADS, len(moved))) as pool:
            futures = [pool.submit(self._entries, repo, sha) for repo, sha in moved]
        for future in futures:
            with contextlib.suppress(BusError):
                future.result()

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

    def requests_spent(self) -> int | None:
        return self.poll_requests

    def list_deltas(
        self, collaborators: dict[str, dict[str, Any]] | None, *, exhaustive: bool = False
    ) -> list[DeltaRef]:
        listed = collaborators if collaborators is not None else self.collaborators()
        by_repo: dict[str, list[str]] = {}
        for node in listed:
            try:
                by_repo.setdefault(self.delta_repo(node), []).append(node)
            except PermissionDenied as error:  # listed in the config but not in the manifest
                logger.warning("%s", error)
        before = self.requests.taken
        heads = self._listed_heads()
        self._unclaimed = {repo for repo in heads if repo not in by_repo and repo != self.repo_id}
        unlisted = sorted(r for r in by_repo if r not in heads)
        if unlisted:  # checked directly, a few per poll in turn, so the cost stays flat
            start = self._unlisted_turn % len(unlisted)
            per_poll = len(unlisted) if exhaustive else self.unlisted_per_poll
            for repo in (unlisted + unlisted)[start : start + min(per_poll, len(unlisted))]:
                try:
                    heads[repo] = self.sha(repo)
                except (NotFound, PermissionDenied):
                    self._trees.pop(repo, None)
            self._unlisted_turn += self.unlisted_per_poll
        self._prefetch_trees([(repo, heads[repo]) for repo in by_repo if heads.get(repo)])
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
                if not (name.isprintable() and node.isprintable()):
                    self._skip_unprintable(entry.path)
                    continue
                refs.append(DeltaRef(node, name, entry.size, f"{repo}:{entry.path}", etag))
        self.polls += 1
        self.poll_requests += self.requests.taken - before
        return refs

    def unclaimed_sources(self) -> set[str]:
        return set(self._unclaimed)

    def _skip_unprintable(self, path: str) -> None:
        """A delta path with control characters is never listed; said once per path, escaped."""
        if path not in self._unprintable:
            self._unprintable.add(path)
            logger.warning(
                "DiLoCo bus: skipping %s (an unprintable name); it is never read", shown_name(path)
            )

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
        self._check_writable(repo)
        try:
            self.sha(repo)
        except PermissionDenied:
            if repo == self.repo_id:
                raise
            self.create_delta_repo(repo)
            return
        if repo != self.repo_id:
            self.ensure_tagged(repo, f"Deltas of node {node}")

    def _check_writable(self, repo: str) -> None:
        """PermissionDenied unless the token may write into `repo`'s namespace."""
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

    # -- leases ---------------------------------------------------------------------------------
    def _lease(self, name: str) -> tuple[str, str]:
        """(repo, path) of `name`'s lease: the node's own delta repo, the run repo for "master"."""
        return (self.repo_id if name == "master" else self.delta_repo(name)), f"leases/{name}.json"

    def _lease_at(self, repo: str, path: str, sha: str) -> dict[str, Any] | None:
        try:
            return loads(self._download(repo, path, sha), f"{repo}/{path}")
        except NotFound:
            return None
        except BusError as error:
            if isinstance(error, (PermissionDenied, TransientBusError)):
                raise
            return {}  # an unreadable lease protects nothing: taken over

    def claim(self, name: str, holder: str, ttl_s: float) -> Claim:
        from huggingface_hub import CommitOperationAdd

        repo, path = self._lease(name)
        for _ in range(CAS_ATTEMPTS):
            sha = self.sha(repo)
            current = self._lease_at(repo, path, sha) or {}
            now = time.time()
            other = str(current.get("holder", ""))[:80]
            until = _capped_expiry(current, now, ttl_s)
            if other and other != holder and until > now:
                raise ClaimHeld(
                    f"{repo}: {name!r} is held by {other!r} for another {until - now:.0f}s; another "
                    f"process runs as {name} — use another id, or wait for its lease to expire",
                    holder=other,
                    expires_in=until - now,
                )
            lease = {"name": name, "holder": holder, "expires_at": now + ttl_s, "taken_at": now}
            try:
                info = self._commit(
                    repo, [CommitOperationAdd(path, dumps(lease))], f"lease {name}", parent_commit=sha
                )
            except Stale:
                continue  # another commit came first: read the lease again
            oid = str(getattr(info, "oid", "") or "")
            return Claim(name, holder, lease["expires_at"], oid, continued=other == holder)
        raise TransientBusError(f"{repo}: the repo kept moving; no lease on {name!r} taken")

    def lease_left(self, name: str) -> float | None:
        repo, path = self._lease(name)
        current = self._lease_at(repo, path, self.sha(repo))
        if current is None:
            return None
        now = time.time()
        return max(0.0, _capped_expiry(current, now, math.inf) - now)  # the master caps the wait itself

    def release(self, claim: Claim) -> None:
        from huggingface_hub import CommitOperationDelete

        repo, path = self._lease(claim.name)
        for _ in range(CAS_ATTEMPTS):
            sha = self.sha(repo)
            current = self._lease_at(repo, path, sha)
            if not current or current.get("holder") != claim.holder:
                return  # gone, or taken over since: not ours to remove
            try:
                self._commit(repo, [CommitOperationDelete(path)], f"release {claim.name}", parent_commit=sha)
                return
            except Stale:
                continue


def _capped_expiry(lease: dict[str, Any], now: float, ttl_s: float) -> float:
    """A lease's expiry, at most one ttl (the claimer's) after it was taken (never later than now): a
    planted far-future expiry locks no one out for longer than one lease. Junk reads as expired."""
    try:
        until, taken = float(lease.get("expires_at", 0)), float(lease.get("taken_at", now))
    except (TypeError, ValueError):
        return 0.0
    taken = min(taken, now) if taken == taken else now  # NaN: as if taken now
    return min(until, taken + ttl_s) if until == until else 0.0
