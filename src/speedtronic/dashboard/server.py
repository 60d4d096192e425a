"""The dashboard's HTTP server: the stdlib's ThreadingHTTPServer, read-only, serving

    /                    the page (static/index.html; its script and style under /static/)
    /api/state           every source as last read: {now, sources: [{id, kind, label, age_s, error, …}]}
    /api/status?source=N the `hub status --json` document of swarm source N, as last read
    /api/runs?source=N   the runs of runs source N (summaries and curves)

It answers GET and HEAD only (anything else: 405), reads nothing but the collector's kept documents
and its own package files (a fixed list: no path from the request reaches the file system), and sends
every JSON answer through `secrets.scrub`. Bound to 127.0.0.1 it also refuses a request whose Host
header is not a loopback name (a web page elsewhere cannot reach it by DNS rebinding). The page's
Content-Security-Policy allows only this server's own script and style: no CDN, works offline.
"""

from __future__ import annotations

import json
import logging
import math
import socket
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from speedtronic.dashboard.collect import Collector
from speedtronic.secrets import scrub

logger = logging.getLogger("speedtronic.dashboard")

STATIC = {  # URL path -> (package file, content type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
    "/favicon.ico": ("favicon.svg", "image/svg+xml"),
    "/static/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


def finite_only(value: Any) -> Any:
    """`value` with every NaN or infinity (head.json may hold them: Python's json reads them) as null,
    which the browser's JSON.parse accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite_only(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_only(v) for v in value]
    return value


def static_file(name: str) -> bytes:
    return resources.files("speedtronic.dashboard").joinpath("static", name).read_bytes()


class DashboardServer(ThreadingHTTPServer):
    """An HTTP server that knows its collector, and whether it only answers loopback Host names."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], collector: Collector, loopback_only: bool) -> None:
        if ":" in address[0]:  # an IPv6 address (--host ::1)
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)
        self.collector = collector
        self.loopback_only = loopback_only
        self.files = {path: static_file(name) for path, (name, _) in STATIC.items()}

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else host
        return f"http://{shown}:{port}/"


class Handler(BaseHTTPRequestHandler):
    """GET and HEAD of the page, its files and the JSON endpoints; nothing else."""

    server: DashboardServer
    server_version = "speedtronic-dashboard"
    sys_version = ""

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _refuse(self) -> None:
        self._send(405, b"read-only: GET and HEAD only\n", "text/plain; charset=utf-8", True)

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

    def _answer(self, body: bool) -> None:
        if self.server.loopback_only and not self._loopback_host():
            self._send(421, b"this dashboard answers on 127.0.0.1 only\n", "text/plain; charset=utf-8", body)
            return
        url = urlsplit(self.path)
        if url.path in STATIC:
            self._send(200, self.server.files[url.path], STATIC[url.path][1], body)
            return
        found = self._api(url.path, parse_qs(url.query))
        if found is None:
            self._send(404, b"not found\n", "text/plain; charset=utf-8", body)
            return
        code, document = found
        data = scrub(json.dumps(finite_only(document), allow_nan=False, default=str)).encode()
        self._send(code, data, "application/json", body)

    def _api(self, path: str, query: dict[str, list[str]]) -> tuple[int, Any] | None:
        collector = self.server.collector
        if path == "/api/state":
            return 200, collector.state()
        if path not in ("/api/status", "/api/runs"):
            return None
        try:
            index = int((query.get("source") or ["0"])[0])
        except ValueError:
            return 400, {"error": "source: give a source's number (0, 1, …)"}
        if path == "/api/status":
            status = collector.status(index)
            return (
                (200, status) if status is not None else (503, {"error": f"no status of source {index} yet"})
            )
        sources = collector.state()["sources"]
        if 0 <= index < len(sources) and sources[index]["kind"] == "runs":
            return 200, {"runs": sources[index].get("runs") or []}
        return 404, {"error": f"source {index} is not a runs folder"}

    def _loopback_host(self) -> bool:
        host = (self.headers.get("Host") or "").strip().lower()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name in LOOPBACK

    def _send(self, code: int, data: bytes, content_type: str, body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        if content_type.startswith("text/html"):
            self.send_header("Content-Security-Policy", CSP)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("dashboard: " + format, *args)


def serve(collector: Collector, host: str, port: int) -> DashboardServer:
    """A server bound to host:port (0: a free port), not yet serving (call serve_forever)."""
    return DashboardServer((host, port), collector, loopback_only=host in LOOPBACK)
