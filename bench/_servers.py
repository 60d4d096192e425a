"""The buses bench/chaos.py runs on, each with the two faults the soak needs: "down" (the bus gone for a
while, then back with everything it held) and a "storm" (every request answered 429 or 500 for a while).

- `DirectoryBus`: `file://<dir>`. Down: the run directory bind-mounted read-only over itself (every
  write fails with EROFS, as when a storage is remounted read-only), then unmounted: writable again.
  Needs root (mount). A permission taken away (EACCES/EPERM: chmod, chattr +i) is not an outage to
  the directory bus but a misconfiguration: the node that meets it stops with one line saying which
  directory it cannot write (by design). No storm (a directory has no status codes).
- `S3Bus`: moto's S3 server (as tests/s3_server.py runs it: one request at a time, so conditional
  writes are atomic) in a subprocess, with a fault switch in front of moto's app (`POST /_chaos/storm`
  answers every other request with the status asked for, until a deadline), and a TCP gate in this
  process in front of it all: down closes the listening socket and cuts every open connection
  (connection refused, as a stopped server), up listens again on the same port. moto's data lives in
  the subprocess, so it survives the outage. The bench itself reads the bucket past the gate.
- `HubBus`: the loopback Hub of tests/hub_server.py in this process (its `stop()`/`start()` are down and
  up on the same port, its `fail_next` the storm; state in memory survives both).

Run by hand: `python bench/_servers.py s3 PORT` serves moto with the fault switch on PORT.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
ACCESS_KEY = "AKIATESTSPEEDTRONIC1"  # the loopback server's own credentials (never real ones)
SECRET_KEY = "s3cr3t/Speedtronic+TestKey0123456789abcd"
OWNER = "owner"


CREDENTIAL_RE = re.compile(r"Credential=([A-Z0-9]+)/")
KEYS: dict[str, str] = {ACCESS_KEY: "bench"}  # access key id -> the node it names (S3 request counts)


def node_key(node: str) -> str:
    """The access key id a node uses on the loopback S3 server: its own, so the server can count each
    node's requests (moto checks no key: the secret is the same for all)."""
    key = ("AKIASTX" + re.sub(r"[^A-Z0-9]", "", node.upper())).ljust(20, "0")[:20]
    KEYS[key] = node
    return key


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hub_token(user: str) -> str:
    """A loopback Hub token for `user` (the shape tests/swarm_harness.py uses; never a real one)."""
    return f"hf_{user}chaostoken".ljust(24, "0")


# -- the directory bus ----------------------------------------------------------------------------


class DirectoryBus:
    kind = "file"
    storms = False

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.repo = f"file://{root}"
        self._mounted = False

    def env(self, node: str, role: str) -> dict[str, str]:
        return {}

    def down(self) -> None:
        # The run directory bind-mounted read-only over itself: every write fails with EROFS, as on a
        # storage remounted read-only; reads go on.
        subprocess.run(["mount", "--bind", str(self.root), str(self.root)], check=True, capture_output=True)
        self._mounted = True
        subprocess.run(["mount", "-o", "remount,ro,bind", str(self.root)], check=True, capture_output=True)

    def up(self) -> None:
        if self._mounted:
            # Lazy: a process with a file open under the mount keeps it until it closes it.
            subprocess.run(["umount", "-l", str(self.root)], check=False, capture_output=True)
            self._mounted = False

    def storm(self, status: int, seconds: float) -> None:
        raise ValueError("the directory bus has no status codes to storm")

    def read(self, path: str) -> bytes | None:
        try:
            with open(self.root / path, "rb") as f:
                return f.read(16 << 20)
        except OSError:
            return None

    def delta_ids(self) -> set[str]:
        found: set[str] = set()
        with contextlib.suppress(OSError), os.scandir(self.root / "deltas") as nodes:
            for node in nodes:
                if node.is_dir(follow_symlinks=False):
                    with contextlib.suppress(OSError), os.scandir(node.path) as files:
                        found.update(
                            f"{node.name}/{f.name}" for f in files if f.name.endswith(".safetensors")
                        )
        return found

    def close(self) -> None:
        self.up()


# -- S3 (moto) ---------------------------------------------------------------------------------------


class Gate:
    """A TCP forwarder on 127.0.0.1:`port` to `backend`; `down()` refuses and cuts, `up()` listens again."""

    def __init__(self, backend: int) -> None:
        self.backend = backend
        self.port = free_port()
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        with self.lock:
            if self.listener is not None:
                return
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            sock.listen(128)
            self.listener = sock
        threading.Thread(target=self._accept, args=(sock,), daemon=True).start()

    def down(self) -> None:
        with self.lock:
            sock, self.listener = self.listener, None
            conns, self.conns = list(self.conns), set()
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.backend), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self.lock:
                if self.listener is not listener:  # went down meanwhile
                    client.close()
                    server.close()
                    return
                self.conns.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self.lock:
                self.conns.discard(src)
                self.conns.discard(dst)
            src.close()


class S3Bus:
    kind = "s3"
    storms = True
    bucket = "chaos"

    def __init__(self, folder: Path) -> None:
        self.backend = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        log = open(folder / "moto.log", "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "s3", str(self.backend)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self.direct = f"http://127.0.0.1:{self.backend}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.direct}/moto-api/data.json", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the moto S3 server on port {self.backend} did not start") from None
                time.sleep(0.2)
        self.gate = Gate(self.backend)
        self.url = f"http://127.0.0.1:{self.gate.port}"
        self.client = self._client()
        self.client.create_bucket(Bucket=self.bucket)
        self.repo = f"s3://{self.bucket}/run"
        self.folder = folder

    def _client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.direct,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=10),
        )

    def env(self, node: str, role: str) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": node_key(node),
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
            "AWS_CONFIG_FILE": str(self.folder / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.folder / "no-aws-credentials"),
        }

    def down(self) -> None:
        self.gate.down()

    def up(self) -> None:
        self.gate.up()

    def requests(self) -> dict[str, dict[str, int]]:
        """Requests the server answered so far, per node (as `env` named it) and HTTP method; "bench"
        is this process' own reads (the watcher's)."""
        with urllib.request.urlopen(f"{self.direct}/_chaos/requests", timeout=10) as answer:
            counts: dict[str, dict[str, int]] = json.loads(answer.read())
        return {KEYS.get(key, key): methods for key, methods in counts.items()}

    def targets(self) -> dict[str, dict[str, int]]:
        """The same requests as `requests`, per node and what they touched (`request_target`)."""
        with urllib.request.urlopen(f"{self.direct}/_chaos/targets", timeout=10) as answer:
            counts: dict[str, dict[str, int]] = json.loads(answer.read())
        return {KEYS.get(key, key): found for key, found in counts.items()}

    def storm(self, status: int, seconds: float) -> None:
        body = json.dumps({"status": status, "seconds": seconds}).encode()
        request = urllib.request.Request(f"{self.direct}/_chaos/storm", data=body, method="POST")
        urllib.request.urlopen(request, timeout=10).read()

    def read(self, path: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=f"run/{path}")["Body"].read()
        except Exception:  # absent, or moto busy: the watcher looks again
            return None

    def delta_ids(self) -> set[str]:
        out: set[str] = set()
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix="run/deltas/"
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    parts = obj["Key"].split("/")
                    if len(parts) >= 4 and parts[-1].endswith(".safetensors"):
                        out.add(f"{parts[-2]}/{parts[-1]}")
        except Exception:
            return set()
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.gate.down()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def serve_s3(port: int) -> None:
    """moto's S3 app, one request at a time (tests/s3_server.py's reason), behind the storm switch."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()
    storm = {"status": 0, "until": 0.0, "count": 0}
    counts: dict[str, Counter[str]] = {}
    targets: dict[str, Counter[str]] = {}  # the same requests by what they touched (request_target)
    counting = threading.Lock()

    def switch(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ.get("PATH_INFO") == "/_chaos/requests":
            start_response("200 OK", [("Content-Type", "application/json")])
            with counting:
                return [json.dumps({k: dict(v) for k, v in counts.items()}).encode()]
        if environ.get("PATH_INFO") == "/_chaos/targets":
            start_response("200 OK", [("Content-Type", "application/json")])
            with counting:
                return [json.dumps({k: dict(v) for k, v in targets.items()}).encode()]
        key = CREDENTIAL_RE.search(environ.get("HTTP_AUTHORIZATION", ""))
        who = key[1] if key else "anonymous"
        with counting:
            counts.setdefault(who, Counter())[environ.get("REQUEST_METHOD", "?")] += 1
            targets.setdefault(who, Counter())[request_target(environ)] += 1
        if environ.get("PATH_INFO") == "/_chaos/storm":
            size = int(environ.get("CONTENT_LENGTH") or 0)
            asked = json.loads(environ["wsgi.input"].read(size) or b"{}")
            storm.update(status=int(asked["status"]), until=time.monotonic() + float(asked["seconds"]))
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b"{}"]
        if storm["status"] and time.monotonic() < storm["until"]:
            storm["count"] += 1
            if storm["count"] % 2:  # every other request: a storm, not an outage
                return _storm_answer(int(storm["status"]), start_response)
        with lock:
            return list(app(environ, start_response))

    run_simple("127.0.0.1", port, switch, threaded=True, request_handler=MotoRequestHandler)


def request_target(environ: dict[str, Any]) -> str:
    """What an S3 request touched, for counting: its method and the run's top-level entry ("GET deltas",
    "PUT head.json"); a listing is "LIST" and the prefix's entry, a multi-object delete "POST delete"."""
    method = environ.get("REQUEST_METHOD", "?")
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    parts = [p for p in urllib.parse.unquote(environ.get("PATH_INFO", "")).split("/") if p]
    if "delete" in query:
        return f"{method} delete"
    if method == "GET" and ("list-type" in query or len(parts) == 1):
        prefix = query.get("prefix", [""])[0].split("/")
        return "LIST " + (prefix[1] if len(prefix) > 1 and prefix[1] else "(run)")
    entry = parts[2] if len(parts) > 2 else "(bucket)"
    return f"{method} {entry}"


def _storm_answer(status: int, start_response: Any) -> list[bytes]:
    code = "SlowDown" if status in (429, 503) else "InternalError"
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>chaos</Message></Error>".encode()
    reason = {429: "Too Many Requests", 500: "Internal Server Error", 503: "Slow Down"}.get(status, "Error")
    headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body))), ("Retry-After", "1")]
    start_response(f"{status} {reason}", headers)
    return [body]


# -- the loopback Hub ----------------------------------------------------------------------------------


class HubBus:
    kind = "hub"
    storms = True

    def __init__(self, folder: Path, run: str = "chaos-run") -> None:
        sys.path.insert(0, str(TESTS))
        from hub_server import HubServer

        self.server = HubServer()
        # Safetensors go up as LFS, raw, as the Hub takes them (every process runs with Xet disabled:
        # env()); soaks whose JSON has no `hub_uploads` key sent them as base64 in the commits.
        self.server.state.lfs_suffixes = (".safetensors",)
        self.server.state.add_user(OWNER, hub_token(OWNER))
        self.repo = f"{OWNER}/{run}"
        self.url = self.server.url
        self.folder = folder
        self._storm: dict[str, Any] = {"status": 0, "until": 0.0, "count": 0}
        self._scanned: dict[str, int] = {}  # commits of each repo the watcher has read
        self._seen_ids: set[str] = set()
        self._patch_faults()

    def env(self, node: str, role: str) -> dict[str, str]:
        user = OWNER if role == "master" else node
        return {
            "HF_HUB_DISABLE_XET": "1",
            "HF_ENDPOINT": self.url,
            "HF_TOKEN": hub_token(user),
            "HF_HOME": str(self.folder / f"hf-{node}"),
        }

    def add_user(self, node: str) -> None:
        self.server.state.add_user(node, hub_token(node))

    def down(self) -> None:
        self.server.stop()

    def up(self) -> None:
        if self.server.httpd is None:
            self.server.start()

    def storm(self, status: int, seconds: float) -> None:
        """Every other request answered `status` (429 with Retry-After: 1) until `seconds` have passed."""
        self._storm.update(status=status, until=time.monotonic() + seconds)

    def _patch_faults(self) -> None:
        # The server's own fault list answers the next N requests; a storm is timed and hits every
        # other request, so it goes in front of the server's check (this process's copy only).
        import hub_server

        original = hub_server.Handler._fault
        storm = self._storm

        mine = self.server.state

        def _fault(handler: Any) -> bool:
            if handler.state is mine and storm["status"] and time.monotonic() < storm["until"]:
                with handler.state.lock:
                    storm["count"] += 1
                    hit = storm["count"] % 2 == 1
                if hit:
                    handler._error(int(storm["status"]), "chaos storm", head=handler.command == "HEAD")
                    return True
            return original(handler)

        hub_server.Handler._fault = _fault

    def read(self, path: str) -> bytes | None:
        with self.server.state.lock:
            repo = self.server.state.repos.get(self.repo)
            return repo.head[1].get(path) if repo is not None and repo.commits else None

    def delta_ids(self, history: bool = True) -> set[str]:
        """Every delta any commit ever held (exact, even for one deleted right after it landed), or (not
        `history`) those at the heads. With history, only commits not looked at before are read: the
        server's lock, which every request takes, is held for a list copy, not a scan of the run."""
        with self.server.state.lock:
            repos = list(self.server.state.repos.values())
            if history:
                fresh = [
                    (r.repo_id, len(r.commits), r.commits[self._scanned.get(r.repo_id, 0) :]) for r in repos
                ]
            else:
                fresh = [(r.repo_id, 0, r.commits[-1:]) for r in repos]
        found: set[str] = set()
        for repo_id, count, commits in fresh:
            for _, files in commits:
                for path in list(files):
                    parts = path.split("/")
                    if len(parts) >= 3 and parts[-3] == "deltas" and parts[-1].endswith(".safetensors"):
                        found.add(f"{parts[-2]}/{parts[-1]}")
            if history:
                self._scanned[repo_id] = count
        if not history:
            return found
        self._seen_ids |= found
        return set(self._seen_ids)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop()


def open_bus(kind: str, folder: Path) -> DirectoryBus | S3Bus | HubBus:
    if kind == "file":
        return DirectoryBus(folder / "bus")
    if kind == "s3":
        return S3Bus(folder)
    if kind == "hub":
        return HubBus(folder)
    raise ValueError(f"--bus {kind!r}: file, s3 or hub")


@contextlib.contextmanager
def opened(kind: str, folder: Path) -> Iterator[DirectoryBus | S3Bus | HubBus]:
    bus = open_bus(kind, folder)
    try:
        yield bus
    finally:
        bus.close()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "s3":
        serve_s3(int(sys.argv[2]) if len(sys.argv) > 2 else 5000)
    else:
        raise SystemExit("usage: python bench/_servers.py s3 [PORT]")
