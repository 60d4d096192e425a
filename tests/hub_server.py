"""A loopback Hugging Face Hub-compatible server for tests, driven by the real huggingface_hub client.

Standard library only: a ThreadingHTTPServer on 127.0.0.1 (port 0), repos in memory under one
lock, an immutable snapshot per commit. It speaks the endpoints the client uses for model repos
(see ../shared/design/HUB_TESTING.md): whoami-v2, repos/create|delete, repo info (+ settings,
access grants), preupload ("regular" uploads, so the commit carries the file as base64, unless
`state.lfs_suffixes` names the file's suffix: then "lfs", as the Hub answers for safetensors), the LFS
batch API with the basic transfer (the client PUTs the raw bytes to the href it is given; the server
keeps them by sha256), NDJSON commits (file, lfsFile, deletedFile, deletedFolder; parentCommit → 412
when stale), tree listing (an LFS file's entry carries `lfs`), HEAD/GET resolve and
super-squash, and organisation member listing; dataset repos (`repo_type="dataset"`) too, through the
same endpoints under /api/datasets/ and /datasets/, kept apart from models (`repo_key`). Permissions follow the Hub's: a user writes its own
namespace and orgs where it has a write role; private repos are readable by the namespace's members
only (401 RepoNotFound for anyone else, as the Hub answers), gated ones by members and users granted
access (403 GatedRepo for the others, 401 anonymous). `state.commit_log` records (repo, who, paths
touched) per commit.

Listing: `GET /api/models?filter=TAG&author=NS` answers the repos the caller may see whose README
model-card metadata carries every TAG, with their head `sha` and `lastModified`, `page_size` per page
(Link: rel="next", like the Hub's 1,000).

The Hub's limits, when set: `limit_requests(n, window)` answers a token's requests beyond n per
window seconds (anonymous ones per client address) with 429 + Retry-After (the seconds until the
window frees a slot) and RateLimit headers; `limit_commits(n, window)` does the same for commits
to one repo beyond n per window. `state.throttled` counts the 429s; `state.by_token` every request
per token.

Fault injection, for resilience tests: `fail_next(n, status, match)` answers the next n matching
requests with `status` (429 carries Retry-After), `hang_next(n, seconds, match)` accepts and never
answers in time, `stop()`/`start()` take the server down and back up on the same port.
LFS is opt-in (`lfs_suffixes`, or `python tests/hub_server.py --lfs .safetensors`) because a client with
hf_xet installed sends LFS files through Xet, which this server does not speak: its processes need
HF_HUB_DISABLE_XET=1. Bench/wan.py turns it on so that what crosses its link is what crosses the Hub's:
the real Hub takes safetensors raw (LFS or Xet), never as a commit's base64.

Run it by hand with `python tests/hub_server.py` (prints the URL and a token).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse


@dataclass
class Repo:
    repo_id: str
    private: bool
    gated: bool | str = False
    granted: set[str] = field(default_factory=set)
    commits: list[tuple[str, dict[str, bytes]]] = field(default_factory=list)
    modified: str = field(default_factory=lambda: _now())

    @property
    def head(self) -> tuple[str, dict[str, bytes]]:
        return self.commits[-1]


@dataclass
class Fault:
    kind: str  # "status" | "hang" | "hang_after" (process the request, then never answer)
    remaining: int
    status: int = 503
    seconds: float = 0.0
    match: str = ""


class HubState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.repos: dict[str, Repo] = {}
        self.tokens: dict[str, tuple[str, str]] = {}  # token -> (user, role "read"|"write")
        self.orgs: dict[str, dict[str, str]] = {}  # org -> {user: role}
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []
        self.commit_count: dict[str, int] = {}
        self.commit_log: list[tuple[str, str, list[str]]] = []  # (repo, who, paths it touched) per commit
        self.down = False
        self.connections: set[Any] = set()
        self.page_size = 1000
        self.request_limit: tuple[int, float] | None = None  # (requests, window s) per token
        self.commit_limit: tuple[int, float] | None = None  # (commits, window s) per repo
        self.request_times: dict[str, list[float]] = {}
        self.commit_times: dict[str, list[float]] = {}
        self.throttled: list[tuple[str, str]] = []  # (who, "requests" | repo) per 429 answered
        self.by_token: dict[str, int] = {}
        # LFS (opt-in): files whose name ends with one of these are "lfs" uploads. Uploaded objects are
        # kept by sha256, as the Hub's storage keeps them: a commit retried after a lost answer names
        # objects the client will not upload again (it marks them uploaded), and a batch call for an
        # object already here answers "nothing to upload". Commits share the bytes, so this costs memory
        # only for what a squash dropped from the history.
        self.lfs_suffixes: tuple[str, ...] = ()
        self.lfs_objects: dict[str, bytes] = {}
        self.lfs_uploads: list[str] = []  # oids in the order their bytes arrived

    @staticmethod
    def _admit(times: list[float], limit: tuple[int, float]) -> float:
        """0 when one more event fits in the window (and record it), else the seconds to wait."""
        count, window = limit
        now = time.monotonic()
        while times and times[0] <= now - window:
            times.pop(0)
        if len(times) >= count:
            return times[0] + window - now
        times.append(now)
        return 0.0

    def add_user(self, user: str, token: str, role: str = "write") -> None:
        self.tokens[token] = (user, role)

    def can_write(self, user: str | None, role: str, namespace: str) -> bool:
        if user is None or role != "write":
            return False
        return namespace == user or self.orgs.get(namespace, {}).get(user) in ("write", "admin")

    def can_read(self, user: str | None, role: str, repo: Repo) -> bool:
        namespace = repo.repo_id.split("/")[0]
        member = user is not None and (namespace == user or user in self.orgs.get(namespace, {}))
        if repo.private:
            return member
        if repo.gated:
            return member or (user is not None and user in repo.granted)
        return True


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def _tags(readme: bytes) -> list[str]:
    """The `tags:` list of a README's model-card metadata (YAML front matter)."""
    lines = readme.decode("utf-8", "replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return []
    tags: list[str] = []
    inside = False
    for line in lines[1:]:
        if line.strip() == "---":
            break
        if line.startswith("tags:"):
            inside = True
        elif inside and line.lstrip().startswith("- "):
            tags.append(line.lstrip()[2:].strip())
        elif inside and line and not line.startswith(" "):
            inside = False
    return tags


def repo_key(repo_id: str, kind: str = "models") -> str:
    """Where a repo lives in `HubState.repos`: a model by its id, a dataset as `datasets/ID`."""
    return repo_id if kind == "models" else f"{kind}/{repo_id}"


def _sha(files: dict[str, bytes], parent: str) -> str:
    digest = hashlib.sha1(parent.encode())
    for path in sorted(files):
        digest.update(path.encode() + hashlib.sha1(files[path]).digest())
    digest.update(str(time.monotonic_ns()).encode())
    return digest.hexdigest()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: HubState
    base_url: str
    kind = "models"  # the repo type of the request being answered: "models" or "datasets"
    _silent = 0.0  # hang_after: seconds this request's answer is withheld (set by `_fault`)

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.state.lock:
            self.state.connections.add(self.connection)

    def finish(self) -> None:
        with self.state.lock:
            self.state.connections.discard(self.connection)
        super().finish()

    # -- helpers ----------------------------------------------------------------------------------
    def _send(
        self, status: int, body: Any = None, headers: dict[str, str] | None = None, head: bool = False
    ) -> None:
        if self._silent:  # hang_after: processed, but the answer never leaves
            self.close_connection = True
            return
        raw = body if isinstance(body, bytes) else json.dumps(body if body is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        if not isinstance(body, bytes):
            self.send_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(raw)

    def _error(
        self, status: int, message: str, code: str | None = None, head: bool = False, retry_after: int = 1
    ) -> None:
        headers = {"X-Error-Message": message}
        if status == 429:
            headers["Retry-After"] = str(retry_after)
        if code:
            headers["X-Error-Code"] = code
        self._send(status, {"error": message}, headers, head=head)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # a streamed LFS upload
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers, then the blank line
                pass
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _auth(self) -> tuple[str | None, str]:
        header = self.headers.get("Authorization", "")
        token = header[7:] if header.startswith("Bearer ") else None
        user, role = self.state.tokens.get(token or "", (None, "none"))
        return user, role

    def _who(self) -> str:
        header = self.headers.get("Authorization", "")
        user = self.state.tokens.get(header[7:] if header.startswith("Bearer ") else "", (None, ""))[0]
        return user or f"anonymous@{self.client_address[0]}"

    def _rate_limited(self) -> bool:
        """The Hub's request window per token: 429 + Retry-After beyond it."""
        who = self._who()
        with self.state.lock:
            self.state.by_token[who] = self.state.by_token.get(who, 0) + 1
            limit = self.state.request_limit
            if limit is None:
                return False
            wait = self.state._admit(self.state.request_times.setdefault(who, []), limit)
            if not wait:
                return False
            self.state.throttled.append((who, "requests"))
        seconds = max(1, int(wait + 0.999))
        self._send(
            429,
            {"error": f"You have exceeded our request rate limit ({limit[0]} per {limit[1]:g}s)"},
            {
                "Retry-After": str(seconds),
                "RateLimit": f'"api";r=0;t={seconds}',
                "RateLimit-Policy": f'"fixed window";"api";q={limit[0]};w={limit[1]:g}',
                "X-Error-Message": "rate limited",
            },
            head=self.command == "HEAD",
        )
        return True

    def _fault(self) -> bool:
        if self._rate_limited():
            return True
        with self.state.lock:
            self.state.requests.append((self.command, self.path))
            for fault in self.state.faults:
                if fault.remaining > 0 and fault.match in f"{self.command} {self.path}":
                    fault.remaining -= 1
                    break
            else:
                return False
        if fault.kind == "hang":
            time.sleep(fault.seconds)
            self.close_connection = True
            return True
        if fault.kind == "hang_after":
            self._silent = fault.seconds
            return False
        self._error(fault.status, f"injected {fault.status}", head=self.command == "HEAD")
        return True

    def _repo(self, repo_id: str, write: bool = False, head: bool = False) -> Repo | None:
        user, role = self._auth()
        repo = self.state.repos.get(repo_key(repo_id, self.kind))
        if repo is not None and repo.gated and not repo.private and not self.state.can_read(user, role, repo):
            # Like the Hub: a gated repo's content needs a granted access request (401 anonymous).
            self._error(
                403 if user else 401,
                f"Access to model {repo_id} is restricted and you are not in the authorized list. "
                f"Visit {self.base_url}/{repo_id} to ask for access.",
                "GatedRepo",
                head=head,
            )
            return None
        if repo is None or not self.state.can_read(user, role, repo):
            # The Hub answers 401 for a private repo the caller may not read (it does not say it exists).
            status = 401 if repo is not None or not user else 404
            self._error(status, "Repository Not Found", "RepoNotFound", head=head)
            return None
        if write and not self.state.can_write(user, role, repo_id.split("/")[0]):
            self._error(403, f"You don't have the rights to write to {repo_id}", head=head)
            return None
        return repo

    def _revision(self, repo: Repo, rev: str, head: bool = False) -> tuple[str, dict[str, bytes]] | None:
        rev = unquote(rev)
        if rev in ("main", "HEAD"):
            return repo.head
        for sha, files in repo.commits:
            if sha == rev:
                return sha, files
        self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound", head=head)
        return None

    # -- dispatch ---------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        body = self._body() if method in ("POST", "PUT", "DELETE") else b""
        if self.state.down:  # a kept-alive connection that outlived stop()
            self.close_connection = True
            return
        if self._fault():
            return
        url = urlparse(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        query = parse_qs(url.query)
        with self.state.lock, contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._route(method, parts, query, body)
        silent, self._silent = self._silent, 0.0
        if silent:  # the client waits for an answer that does not come (outside the lock: others go on)
            time.sleep(silent)

    def _route(self, method: str, parts: list[str], query: dict[str, list[str]], body: bytes) -> None:
        head = method == "HEAD"
        self.kind = "models"
        if len(parts) >= 4 and parts[:2] == ["api", "datasets"]:
            self.kind = "datasets"
            return self._model_api(method, f"{parts[2]}/{parts[3]}", parts[4:], query, body)
        if len(parts) >= 6 and parts[0] == "datasets" and parts[3] == "resolve" and method in ("GET", "HEAD"):
            self.kind = "datasets"
            return self._resolve(f"{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:]), head)
        if len(parts) >= 6 and parts[-4:] == ["info", "lfs", "objects", "batch"] and method == "POST":
            if parts[0] == "datasets":
                self.kind, parts = "datasets", parts[1:]
            return self._lfs_batch(f"{parts[0]}/{parts[1].removesuffix('.git')}", body)
        if len(parts) == 2 and parts[0] == "lfs-upload" and method == "PUT":
            return self._lfs_put(parts[1], body)
        if parts == ["api", "whoami-v2"]:
            user, role = self._auth()
            if user is None:
                return self._error(401, "Invalid credentials in Authorization header")
            orgs = [{"name": o, "roleInOrg": m[user]} for o, m in self.state.orgs.items() if user in m]
            return self._send(
                200,
                {
                    "type": "user",
                    "name": user,
                    "orgs": orgs,
                    "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": role}},
                },
            )
        if parts == ["api", "repos", "create"] and method == "POST":
            return self._create(json.loads(body or b"{}"))
        if parts == ["api", "repos", "delete"] and method == "DELETE":
            data = json.loads(body or b"{}")
            repo_id = f"{data.get('organization') or self._auth()[0]}/{data['name']}"
            self.kind = "datasets" if data.get("type") == "dataset" else "models"
            if self._repo(repo_id, write=True):
                del self.state.repos[repo_key(repo_id, self.kind)]
                return self._send(200, {})
            return None
        if parts == ["api", "validate-yaml"] and method == "POST":  # the client checks a README's metadata
            return self._send(200, {"errors": [], "warnings": []})
        if parts == ["api", "models"] and method == "GET":
            return self._list_models(query)
        if len(parts) == 4 and parts[:2] == ["api", "organizations"] and parts[3] == "members":
            members = self.state.orgs.get(parts[2])
            if members is None:
                return self._error(404, f"organisation {parts[2]} not found")
            return self._send(
                200, [{"user": u, "fullname": u, "avatarUrl": "", "type": "user"} for u in members]
            )
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            return self._model_api(method, repo_id, rest, query, body)
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
        return self._error(404, f"no route for {method} {self.path}", head=head)

    def _list_models(self, query: dict[str, list[str]]) -> None:
        user, _ = self._auth()
        wanted = set(query.get("filter", []))
        author = query.get("author", [None])[0]
        found = []
        for key in sorted(self.state.repos):
            repo, repo_id = self.state.repos[key], key
            if key != repo.repo_id:
                continue  # a dataset repo: not listed among models
            namespace = repo_id.split("/")[0]
            member = user is not None and (namespace == user or user in self.state.orgs.get(namespace, {}))
            if (repo.private and not member) or (author and namespace != author):
                continue  # gated repos are listed for everyone, like on the Hub
            tags = _tags(repo.head[1].get("README.md", b""))
            if wanted <= set(tags):
                found.append((repo, tags))
        cursor = int(query.get("cursor", ["0"])[0])
        page = found[cursor : cursor + self.state.page_size]
        headers = {}
        if cursor + self.state.page_size < len(found):
            rest = "&".join(f"{k}={v}" for k, vs in query.items() if k != "cursor" for v in vs)
            headers["Link"] = (
                f'<{self.base_url}/api/models?{rest}&cursor={cursor + self.state.page_size}>; rel="next"'
            )
        body = [
            {
                "id": repo.repo_id,
                "modelId": repo.repo_id,
                "sha": repo.head[0],
                "lastModified": repo.modified,
                "private": repo.private,
                "gated": repo.gated,
                "tags": tags,
            }
            for repo, tags in page
        ]
        return self._send(200, body, headers)

    def _create(self, data: dict[str, Any]) -> None:
        user, role = self._auth()
        namespace = data.get("organization") or user
        if user is None:
            return self._error(401, "Invalid credentials")
        if not self.state.can_write(user, role, namespace):
            return self._error(403, f"You don't have the rights to create a repo under {namespace}")
        repo_id = f"{namespace}/{data['name']}"
        kind = "datasets" if data.get("type") == "dataset" else "models"
        if repo_key(repo_id, kind) in self.state.repos:
            message = "You already created this model repo"
            return self._send(
                409, {"error": message, "url": f"{self.base_url}/{repo_id}"}, {"X-Error-Message": message}
            )
        private = data.get("visibility") == "private" or bool(data.get("private"))
        repo = Repo(repo_id, private)
        repo.commits.append((_sha({}, repo_id), {}))
        self.state.repos[repo_key(repo_id, kind)] = repo
        return self._send(200, {"url": f"{self.base_url}/{repo_id}", "name": repo_id})

    def _model_api(
        self, method: str, repo_id: str, rest: list[str], query: dict[str, list[str]], body: bytes
    ) -> None:
        if method == "GET" and (not rest or rest[0] == "revision"):
            repo = self._repo(repo_id)
            if repo is None:
                return None
            found = self._revision(repo, rest[1]) if rest else repo.head
            if found is None:
                return None
            sha, files = found
            return self._send(
                200,
                {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": sha,
                    "private": repo.private,
                    "gated": repo.gated,
                    "siblings": [{"rfilename": p} for p in sorted(files)],
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                },
            )
        if method == "PUT" and rest == ["settings"]:
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return None
            data = json.loads(body or b"{}")
            if "gated" in data:
                repo.gated = data["gated"]
            if "private" in data:
                repo.private = bool(data["private"])
            return self._send(200, {})
        if method == "POST" and rest[:2] == ["user-access-request", "grant"]:
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return None
            repo.granted.add(json.loads(body or b"{}")["user"])
            return self._send(200, {})
        if method == "POST" and rest and rest[0] == "preupload":
            if self._repo(repo_id, write=True) is None:
                return None
            files = json.loads(body or b"{}").get("files", [])
            return self._send(
                200,
                {
                    "files": [
                        {"path": f["path"], "uploadMode": self._upload_mode(f["path"]), "shouldIgnore": False}
                        for f in files
                    ]
                },
            )
        if method == "POST" and rest and rest[0] == "commit":
            return self._commit(repo_id, body)
        if method == "POST" and rest and rest[0] == "super-squash":
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return None
            sha, files = repo.head
            repo.commits = [(_sha(files, "squash"), files)]
            return self._send(200, {"commitId": repo.head[0]})
        if method == "GET" and rest and rest[0] == "tree":
            repo = self._repo(repo_id)
            if repo is None:
                return None
            found = self._revision(repo, rest[1])
            if found is None:
                return None
            prefix = "/".join(rest[2:]).strip("/")
            return self._tree(found[1], prefix, query.get("recursive", ["false"])[0] in ("true", "True", "1"))
        return self._error(404, f"no route for {method} {self.path}")

    def _upload_mode(self, path: str) -> str:
        return "lfs" if self.state.lfs_suffixes and path.endswith(self.state.lfs_suffixes) else "regular"

    def _lfs_batch(self, repo_id: str, body: bytes) -> None:
        """The LFS batch API (upload, basic transfer): an href to PUT each object the server lacks."""
        if self._repo(repo_id, write=True) is None:
            return None
        request = json.loads(body or b"{}")
        if request.get("operation") != "upload" or "basic" not in request.get("transfers", ["basic"]):
            return self._error(400, "only uploads with the basic transfer are supported")
        objects = []
        for item in request.get("objects", []):
            oid, size = str(item["oid"]), int(item["size"])
            entry: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.state.lfs_objects:  # else already stored: nothing to upload
                entry["actions"] = {"upload": {"href": f"{self.base_url}/lfs-upload/{oid}", "header": {}}}
            objects.append(entry)
        return self._send(200, {"transfer": "basic", "objects": objects})

    def _lfs_put(self, oid: str, body: bytes) -> None:
        """An object's raw bytes, kept only when they hash to the oid they were sent for."""
        if hashlib.sha256(body).hexdigest() != oid:
            return self._error(400, f"the uploaded bytes do not hash to {oid}")
        self.state.lfs_objects[oid] = body
        self.state.lfs_uploads.append(oid)
        return self._send(200, {})

    def _tree(self, files: dict[str, bytes], prefix: str, recursive: bool) -> None:
        base = f"{prefix}/" if prefix else ""
        below = {p: d for p, d in files.items() if p.startswith(base)}
        if prefix and not below:
            return self._error(404, f"{prefix} does not exist", "EntryNotFound")
        entries: dict[str, dict[str, Any]] = {}
        for path, data in below.items():
            rel = path[len(base) :].split("/")
            for depth in range(1, len(rel)):
                folder = base + "/".join(rel[:depth])
                if recursive or depth == 1:
                    entries[folder] = {
                        "type": "directory",
                        "oid": hashlib.sha1(folder.encode()).hexdigest(),
                        "size": 0,
                        "path": folder,
                    }
            if recursive or len(rel) == 1:
                entries[path] = {
                    "type": "file",
                    "oid": hashlib.sha1(data).hexdigest(),
                    "size": len(data),
                    "path": path,
                }
                if self._upload_mode(path) == "lfs":  # as the Hub lists an LFS file (pointer size: git's)
                    sha = hashlib.sha256(data).hexdigest()
                    entries[path]["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
        return self._send(200, [entries[k] for k in sorted(entries)])

    def _commit(self, repo_id: str, body: bytes) -> None:
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return None
        limit = self.state.commit_limit
        if limit is not None:
            wait = self.state._admit(self.state.commit_times.setdefault(repo_id, []), limit)
            if wait:
                self.state.throttled.append((self._who(), repo_id))
                return self._error(
                    429,
                    f"You have exceeded the rate limit for repository commits ({limit[0]} per {limit[1]:g}s)",
                    retry_after=max(1, int(wait + 0.999)),
                )
        parent, files = repo.head
        new = dict(files)
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                wanted = value.get("parentCommit")
                if wanted and wanted != parent:
                    return self._error(412, "A commit has happened since. Please refresh and try again.")
            elif key == "file":
                new[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                data = self.state.lfs_objects.get(str(value.get("oid")))
                if data is None or int(value.get("size", len(data))) != len(data):
                    return self._error(
                        400, f"LFS object {value.get('oid')} of {value['path']} was not uploaded"
                    )
                new[value["path"]] = data
            elif key == "deletedFile":
                new.pop(value["path"], None)
            elif key == "deletedFolder":
                folder = value["path"].rstrip("/") + "/"
                new = {p: d for p, d in new.items() if not p.startswith(folder)}
            else:
                return self._error(400, f"unsupported commit operation {key}")
        sha = _sha(new, parent)
        repo.commits.append((sha, new))
        repo.modified = _now()
        self.state.commit_count[repo_id] = self.state.commit_count.get(repo_id, 0) + 1
        touched = sorted(set(new.items()) ^ set(files.items()))  # added, changed and removed paths
        self.state.commit_log.append((repo_id, self._who(), sorted({path for path, _ in touched})))
        return self._send(
            200, {"commitUrl": f"{self.base_url}/{repo_id}/commit/{sha}", "commitOid": sha, "success": True}
        )

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id, head=head)
        if repo is None:
            return None
        found = self._revision(repo, rev, head=head)
        if found is None:
            return None
        sha, files = found
        if path not in files:
            return self._error(404, "Entry not found", "EntryNotFound", head=head)
        data = files[path]
        etag = '"' + hashlib.sha1(data).hexdigest() + '"'
        return self._send(
            200,
            data,
            {"X-Repo-Commit": sha, "ETag": etag, "Content-Type": "application/octet-stream"},
            head=head,
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client killed mid-request (the chaos soak's kill -9) resets its connection: not a server
        # error worth a traceback on stderr. Anything else still gets one.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HubServer:
    """The server plus its state; `url` is the endpoint to give the client."""

    def __init__(self, port: int = 0) -> None:
        self.state = HubState()
        self.port = port
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.state.down = False
        handler = type("BoundHandler", (Handler,), {"state": self.state, "base_url": ""})
        httpd = _Server(("127.0.0.1", self.port), handler)
        self.port = httpd.server_address[1]
        handler.base_url = self.url
        self.httpd = httpd
        self.thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        """Down: new connections are refused and open ones are cut."""
        self.state.down = True
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        with self.state.lock:
            for conn in list(self.state.connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def fail_next(self, n: int, status: int = 503, match: str = "") -> None:
        with self.state.lock:
            self.state.faults.append(Fault("status", n, status=status, match=match))

    def hang_next(self, n: int, seconds: float, match: str = "") -> None:
        with self.state.lock:
            self.state.faults.append(Fault("hang", n, seconds=seconds, match=match))

    def hang_after_next(self, n: int, seconds: float, match: str = "") -> None:
        """The next n matching requests take effect but their answers never arrive."""
        with self.state.lock:
            self.state.faults.append(Fault("hang_after", n, seconds=seconds, match=match))

    def limit_requests(self, count: int, window: float) -> None:
        with self.state.lock:
            self.state.request_limit = (count, window)

    def limit_commits(self, count: int, window: float) -> None:
        with self.state.lock:
            self.state.commit_limit = (count, window)

    def clear_faults(self) -> None:
        with self.state.lock:
            self.state.faults.clear()

    def files(self, repo_id: str, kind: str = "models") -> dict[str, bytes]:
        with self.state.lock:
            return dict(self.state.repos[repo_key(repo_id, kind)].head[1])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A loopback Hub for tests and by-hand runs.")
    parser.add_argument("--lfs", nargs="*", default=[], help="file suffixes uploaded as LFS (.safetensors)")
    server = HubServer()
    server.state.lfs_suffixes = tuple(parser.parse_args().lfs)
    server.state.add_user("me", "hf_loopbacktoken0000")
    print(f"loopback Hub at {server.url} · user 'me' · token hf_loopbacktoken0000")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
