"""`speedtronic dashboard`: its JSON endpoints and page over real HTTP on 127.0.0.1, against a runs
folder and a real directory bus (`hub init`), a bus that goes away and comes back, a hostile head.json,
and what it must never do (answer a write, another Host, show a token, import torch for --help).
The page in a real browser, against a live swarm: test_dashboard_browser.py."""

from __future__ import annotations

import http.client
import json
import math
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from speedtronic.dashboard.collect import Collector, RunsSource, Source, SwarmSource, classify
from speedtronic.dashboard.history import SwarmHistory
from speedtronic.dashboard.server import STATIC, DashboardServer, serve, static_file
from speedtronic.errors import ConfigError
from speedtronic.secrets import remember_secret
from swarm_harness import wait_until, write_config

SECRET = "hf_dashboardsecret0123456789"


def write_run(root: Path, name: str, losses: list[float], core: float | None = None) -> Path:
    """A run folder as the jsonl hook writes it: train_start, steps, evals, train_end."""
    folder = root / name
    folder.mkdir(parents=True)
    events: list[dict[str, Any]] = [
        {"event": "train_start", "config": {"optimizer": {"name": "adamw", "lr": 3e-4}}}
    ]
    for i, loss in enumerate(losses, 1):
        events.append({"event": "step", "step": i * 10, "loss": loss, "tokens_seen": i * 1000})
        if i % 2 == 0:
            tasks = {"hellaswag": {"accuracy": 0.25 + i / 100}} if core is not None else None
            events.append(
                {"event": "eval", "step": i * 10, "val_loss": loss + 0.1, "core": core, "tasks": tasks}
            )
    events.append(
        {
            "event": "train_end",
            "steps": len(losses) * 10,
            "tokens": len(losses) * 1000,
            "elapsed_s": 12.5,
            "tokens_per_s": 800.0,
        }
    )
    (folder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + "{truncated")
    return folder


class Live:
    """A dashboard server on 127.0.0.1 (a free port) over `sources`, stopped by close()."""

    def __init__(self, sources: list[Source]) -> None:
        self.collector = Collector(sources)
        self.collector.start()
        self.server: DashboardServer = serve(self.collector, "127.0.0.1", 0)
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()
        self.port = self.server.server_address[1]

    def request(
        self, path: str, method: str = "GET", host: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.putrequest(method, path, skip_host=host is not None)
            if host is not None:
                conn.putheader("Host", host)
            conn.endheaders()
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def json(self, path: str) -> Any:
        code, _, body = self.request(path)
        assert code == 200, (code, body[:500])
        return json.loads(body)

    def state(self, until: Callable[[dict[str, Any]], Any] = lambda s: True) -> dict[str, Any]:
        """/api/state once every source was read and `until` holds."""
        return wait_until(
            lambda: (
                (s := self.json("/api/state"))
                and all(x["fetched_at"] or x["error"] for x in s["sources"])
                and until(s)
                and s
            ),
            timeout=60,
            what="the dashboard's state",
            every=0.05,
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.collector.close()


@pytest.fixture
def live() -> Iterator[Callable[[list[Source]], Live]]:
    servers: list[Live] = []

    def start(sources: list[Source]) -> Live:
        servers.append(Live(sources))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_runs_folder_over_http_table_curves_and_tasks(tmp_path: Path, live: Callable[..., Live]) -> None:
    runs = tmp_path / "runs"
    write_run(runs, "small", [4.0, 3.5, 3.1, 2.9], core=0.12)
    write_run(runs, "big", [4.1, 3.2, 2.7, 2.4, 2.2, 2.1])
    server = live([RunsSource(runs, 0.2), RunsSource(runs / "small", 0.2)])
    state = server.state()
    folder, single = state["sources"]
    assert folder["kind"] == "runs" and folder["error"] is None
    by_name = {r["name"]: r for r in folder["runs"]}
    assert set(by_name) == {"small", "big"}
    assert by_name["big"]["train"][-1] == [60, 2.1] and by_name["big"]["final_loss"] == 2.1
    assert by_name["small"]["val"] == [[20, 3.6], [40, pytest.approx(3.0)]]
    assert by_name["small"]["evals"]["hellaswag"][-1] == [40, pytest.approx(0.29)]
    assert "path" not in by_name["small"]  # no local path on the page
    assert [r["name"] for r in single["runs"]] == ["small"]  # one run's own folder
    assert server.json("/api/runs?source=0")["runs"] == folder["runs"]
    # The page and its assets: the same files the wheel ships, with a CSP that allows nothing remote.
    code, headers, body = server.request("/")
    assert code == 200 and b'src="/static/app.js"' in body
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    for path, (name, kind) in STATIC.items():
        code, headers, body = server.request(path)
        assert code == 200 and body == static_file(name) and headers["Content-Type"] == kind


def test_static_assets_load_nothing_from_the_network() -> None:
    """Offline: no CDN, no remote font or script; the only URL is SVG's namespace name."""
    for name in {name for name, _ in STATIC.values()}:
        text = static_file(name).decode()
        remote = text.replace("http://www.w3.org/2000/svg", "")
        assert "http://" not in remote and "https://" not in remote and "//cdn" not in remote, name


def test_read_only_loopback_host_and_no_secret(
    tmp_path: Path, live: Callable[..., Live], restore_secrets: None
) -> None:
    remember_secret(SECRET)
    runs = tmp_path / SECRET  # a path that happens to hold a token: never shown
    write_run(runs, "r", [3.0, 2.0])
    server = live([RunsSource(runs, 0.2)])
    state = server.state()
    assert SECRET not in json.dumps(state) and "**********" in state["sources"][0]["label"]
    for method in ("POST", "PUT", "DELETE"):
        assert server.request("/api/state", method)[0] == 405
    assert server.request("/api/state", host="evil.example:80")[0] == 421  # DNS rebinding
    assert server.request("/api/state", host=f"localhost:{server.port}")[0] == 200
    assert server.request("/../../etc/passwd")[0] == 404
    assert server.request("/api/status?source=zero")[0] == 400
    assert server.request("/api/status?source=0")[0] == 503  # not a swarm


def test_swarm_status_endpoint_is_hub_status_and_survives_the_bus_going_away(
    tmp_path: Path, live: Callable[..., Live]
) -> None:
    """The endpoint serves run_status's document (what `hub status --json` prints); while the bus is
    gone the page keeps the last data, says how old it is and why, and recovers when it is back."""
    from speedtronic.diloco.launch import init_run, run_status

    cfg = write_config(tmp_path)
    bus = tmp_path / "bus"
    init_run(f"file://{bus}", cfg, None, None, private=True, gated=False)
    server = live([classify(str(bus), None, 0.2)])  # a run directory is a directory bus
    state = server.state(lambda s: s["sources"][0].get("status"))
    source = state["sources"][0]
    assert source["kind"] == "swarm" and source["label"] == f"file://{bus.resolve()}"
    assert source["global_bytes"] > 0
    served = server.json("/api/status?source=0")
    expected = run_status(f"file://{bus.resolve()}", None)
    assert served == expected
    moved = tmp_path / "elsewhere"
    shutil.move(bus, moved)
    gone = server.state(lambda s: s["sources"][0]["error"])["sources"][0]
    assert "manifest.json is missing" in gone["error"] and gone["status"] == served  # the last data
    reads = gone["reads"]
    time.sleep(0.5)
    assert server.json("/api/state")["sources"][0]["age_s"] >= 0.4  # its age grows
    shutil.move(moved, bus)
    back = server.state(lambda s: s["sources"][0]["reads"] > reads and not s["sources"][0]["error"])
    assert back["sources"][0]["status"]["outer_step"] == served["outer_step"]


def test_hostile_head_never_breaks_the_page(tmp_path: Path, live: Callable[..., Live]) -> None:
    """head.json is anyone-with-write-access's to edit: odd types, NaN, huge lists are served as valid
    JSON (NaN as null) and never kill the collector."""
    from speedtronic.diloco.launch import init_run

    cfg = write_config(tmp_path)
    bus = tmp_path / "bus"
    init_run(f"file://{bus}", cfg, None, None, private=True, gated=False)
    head = json.loads((bus / "head.json").read_text())
    head["status"] = {
        "updated_at": "not a time",
        "global_val_losses": [["x", 2.0], [2, float("nan")], [3, "2.5"], *([s, 1.0] for s in range(4, 2004))],
        "global_eval": {"step": 3, "val_loss": float("inf")},
        "round": {"last": {"outer_step": 2, "closed_by": "<script>alert(1)</script>", "without": "w1"}},
        "nodes": {"<img src=x>": {"applied": "many", "score": {"agreement": float("nan")}}},
    }
    head["peers"] = {"w1": {"agreement": float("nan")}}
    (bus / "head.json").write_text(json.dumps(head))  # Python writes NaN: the bus reads it back
    server = live([SwarmSource(f"file://{bus}", None, 0.2)])
    state = server.state(lambda s: s["sources"][0].get("status") or s["sources"][0]["error"])
    source = state["sources"][0]
    assert source["error"] is None, source["error"]
    code, _, body = server.request("/api/state")
    assert code == 200 and b"NaN" not in body and b"Infinity" not in body
    steps = [p[0] for p in source["history"]["global_loss"]]
    assert steps == list(range(1504, 2004))  # valid points only, the latest 500


def test_history_rounds_token_rates_and_node_curves() -> None:
    history = SwarmHistory()

    def status(step: int, at: str, tokens: int, closed_by: str) -> dict[str, Any]:
        return {
            "outer_step": step,
            "updated_at": at,
            "global_val_losses": [[s, 4.0 - s / 10] for s in range(step + 1)],
            "round": {
                "last": {"outer_step": step, "closed_by": closed_by, "waited_s": 1.5, "without": ["w2"]}
            },
            "collaborators": [
                {
                    "node": "w1",
                    "tokens": tokens,
                    "latest_applied_at": at,
                    "latest_applied_outer_step": step,
                    "eval": {"step": step * 5, "val_loss": 4.5 - step / 10},
                }
            ],
        }

    history.add(status(1, "2026-01-01T00:00:10+00:00", 1000, "all"))
    history.add(status(2, "2026-01-01T00:00:20+00:00", 3000, "grace"))
    history.add(status(2, "2026-01-01T00:00:20+00:00", 3000, "grace"))  # the same poll twice
    doc = history.document()
    assert [p[0] for p in doc["global_loss"]] == [0, 1, 2]
    assert doc["rounds"][-1] == {
        "outer_step": 2,
        "at": pytest.approx(1767225620.0),
        "duration_s": 10.0,
        "closed_by": "grace",
        "waited_s": 1.5,
        "without": ["w2"],
    }
    assert doc["tokens_per_s"]["w1"] == [[pytest.approx(1767225620.0), 200.0]]
    assert [p[3] for p in doc["node_loss"]["w1"]] == [5, 10] and doc["node_loss"]["w1"][-1][0] == 2
    assert all(math.isfinite(p[1]) for p in doc["global_loss"])


def test_classify_names_what_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    assert isinstance(classify(str(tmp_path / "runs"), None, None), RunsSource)
    assert classify("s3://bucket/run", None, None).interval_s == 30.0
    assert classify("owner/run", None, None).kind == "swarm"
    with pytest.raises(ConfigError, match="not a folder of runs"):
        classify(str(tmp_path / "missing" / "x" / "y"), None, None)


def test_cli_help_prints_the_options_and_a_bad_source_exits_2(run_cli: Callable[..., Any]) -> None:
    result = run_cli(
        python_code="import sys\nfrom speedtronic.cli import main\n"
        "try:\n    main(['dashboard', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules)"
    )
    assert result.returncode == 0, result.stderr
    assert "--port" in result.stdout and "--host" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "False"  # --help stays light
    bad = run_cli("dashboard", "no/such/place/here")
    assert bad.returncode == 2 and "not a folder of runs" in bad.stderr


def test_every_static_file_ships_in_the_wheel() -> None:
    """pyproject's package-data names the page's files (a wheel without them serves nothing)."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = root / "src" / "speedtronic"
    files = [p.relative_to(package).as_posix() for p in (package / "dashboard" / "static").iterdir()]
    assert {name for name, _ in STATIC.values()} <= {f.split("/")[-1] for f in files}
    missing = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns["speedtronic"])]
    assert missing == []


def test_cli_prints_the_url_serves_and_warns_when_exposed(tmp_path: Path) -> None:
    """The command as a user runs it: it prints the URL it serves; another --host than loopback warns."""
    import os
    import subprocess
    import sys

    from conftest import SRC_DIR

    runs = tmp_path / "runs"
    write_run(runs, "r", [3.0, 2.5])
    env = {**os.environ, "PYTHONPATH": str(SRC_DIR), "COLUMNS": "200"}
    command = [
        sys.executable,
        "-m",
        "speedtronic",
        "dashboard",
        str(runs),
        "--port",
        "0",
        "--host",
        "127.0.0.2",
    ]
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env)
    try:
        line = wait_until(lambda: proc.poll() is None and out.read_text().strip(), 60, "the URL")
        assert line.startswith("speedtronic dashboard: http://127.0.0.2:")
        host, port = line.split("//")[1].rstrip("/").split(":")

        def runs() -> list[dict[str, Any]]:
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", "/api/runs?source=0")
            response = conn.getresponse()
            assert response.status == 200
            return json.loads(response.read())["runs"]

        assert wait_until(runs, 60, "the runs read")[0]["name"] == "r"
        assert "warning: the dashboard listens on 127.0.0.2" in err.read_text()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_hub_run_is_shown_without_its_token(
    tmp_path: Path, live: Callable[..., Live], monkeypatch: pytest.MonkeyPatch, restore_secrets: None
) -> None:
    """`speedtronic dashboard owner/name` on the loopback Hub: the status is hub status's, the token the
    bus reads with (HF_TOKEN) appears nowhere in what the server sends."""
    from speedtronic.diloco.launch import run_status
    from swarm_harness import OWNER, Swarm, token

    swarm = Swarm(tmp_path, "hub")
    try:
        swarm.init(write_config(tmp_path), ["w1"])
        monkeypatch.setenv("HF_TOKEN", token(OWNER))
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        server = live([classify(swarm.repo, swarm.server.url, 0.5)])
        source = server.state(lambda s: s["sources"][0].get("status") or s["sources"][0]["error"])["sources"][
            0
        ]
        assert source["kind"] == "swarm" and source["error"] is None, source["error"]
        assert "w1" in [c["node"] for c in source["status"]["collaborators"]], source["status"]
        status = server.json("/api/status?source=0")
        assert status["fingerprint"] == run_status(swarm.repo, swarm.server.url)["fingerprint"]
        for path in ("/api/state", "/api/status?source=0", "/"):
            assert token(OWNER).encode() not in server.request(path)[2]
    finally:
        swarm.close()


def test_the_ledger_sums_what_applied_deltas_claimed() -> None:
    """tokens_claimed (the node table's "claimed"): the digits a delta's metadata claims, summed; a
    malformed claim, or a malformed running sum adopted from a bus head, counts 0."""
    from speedtronic.diloco.bus.base import DeltaRef
    from speedtronic.diloco.master.ledger import Ledger

    ledger = Ledger()
    ref = DeltaRef("w1", "w1--00000000.safetensors", 10, "x")
    ledger.apply(ref, 0, "c0", 100, {"tokens": "5000"}, None)
    ledger.apply(ref, 1, "c1", 100, {"tokens": "1e9"}, None)
    assert ledger.nodes["w1"]["claimed"] == 5000 and ledger.nodes["w1"]["tokens"] == 200
    ledger.nodes["w1"]["claimed"] = "lots"  # as a hostile head.json could hand it over
    ledger.apply(ref, 2, "c2", 100, {"tokens": "7"}, None)
    assert ledger.nodes["w1"]["claimed"] == 7
