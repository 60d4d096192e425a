"""`speedtronic dashboard` in a real browser (headless Chromium driven by selenium) against a live swarm:
a master and two workers on a directory bus, plus a peer whose delta is NaN. The page loads without a
console error, its loss chart reaches the master's outer step, its node table equals `hub status
--json`, the rejected delta shows the check that refused it (`finite`), it fits a phone's width, and
screenshots are saved (into $SPEEDTRONIC_SCREENSHOTS as well, when set).

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package; without them it skips and
says how to install them. .ci/run installs them and sets SPEEDTRONIC_REQUIRE_BROWSER, under which a
missing piece fails the test instead: CI never skips it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from swarm_harness import Swarm, child_env, text_path, wait_until, write_config

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver && pip install selenium"


def missing(why: str) -> NoReturn:
    """Skip, saying how to install what is missing; under .ci/run (which installs the browser) fail."""
    if os.environ.get("SPEEDTRONIC_REQUIRE_BROWSER"):
        pytest.fail(f"{why}, though SPEEDTRONIC_REQUIRE_BROWSER is set; {INSTALL}")
    pytest.skip(f"{why}; to run this test: {INSTALL}")


def browser() -> WebDriver:
    """A headless Chromium at 1280×800 that keeps the console's messages, or a skip saying how to get one."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("selenium is not installed")
    if CHROMIUM is None or DRIVER is None:
        missing("no chromium/chromedriver on this machine")
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def nan_delta(bus_dir: Path, node: str, outer_step: int) -> None:
    """A well-formed delta file whose values are NaN: what the master's `finite` check refuses. Marked
    final, so the master does not wait for more from this node."""
    manifest = DirectoryBus(str(bus_dir)).read_manifest()
    assert manifest is not None
    specs = codec.specs_from_json(manifest["params"])
    tensors = {n: torch.full(s.shape, float("nan")) for n, s in specs.items()}
    meta = {
        "kind": "delta",
        "node": node,
        "seq": "0",
        "local_step": "5",
        "base_outer_step": str(outer_step),
        "tokens": "512",
        "final": "1",
    }
    DirectoryBus(str(bus_dir)).put_delta(node, codec.delta_name(node, 0), codec.encode(tensors, "fp32", meta))


@pytest.fixture
def dashboard(tmp_path: Path, swarm: Swarm) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`speedtronic dashboard <the swarm's bus> --port 0` as a process; yields its URL."""
    out = (tmp_path / "dashboard.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "dashboard", swarm.repo, "--port", "0", "--interval", "0.3"],
        cwd=tmp_path,
        env=child_env(tmp_path, "dashboard", {}),
        stdout=out,
        stderr=(tmp_path / "dashboard.err").open("wb"),
    )
    try:
        line = wait_until(
            lambda: proc.poll() is None and (tmp_path / "dashboard.out").read_text().strip(),
            60,
            "the dashboard's URL",
        )
        yield line.split()[-1], proc
    finally:
        proc.kill()
        proc.wait()
        out.close()


def cells(driver: WebDriver) -> dict[str, dict[str, Any]]:
    """The node table as the page shows it: node -> {key: value} (each cell's data-value, JSON)."""
    rows = driver.execute_script(
        "return [...document.querySelectorAll('table[data-table=nodes] tbody tr')].map(r => "
        "[r.dataset.node, Object.fromEntries([...r.querySelectorAll('td')].map(c => [c.dataset.key, c.dataset.value]))])"
    )
    return {node: {k: json.loads(v) if v else None for k, v in values.items()} for node, values in rows}


def text(driver: WebDriver, selector: str) -> str:
    """An element's text, read in one script (the page redraws itself: a held element goes stale)."""
    script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : ''"
    return str(driver.execute_script(script, selector))


def chart_last_step(driver: WebDriver) -> float | None:
    """The last x of the loss chart's global curve (an outer step, or a Unix time on the wall clock)."""
    value = driver.execute_script(
        "const g = document.querySelector('svg[data-chart=loss] g[data-series=global]');"
        "return g ? g.dataset.lastX : null;"
    )
    return None if value is None else float(value)


def test_dashboard_in_a_browser_against_a_live_swarm(
    tmp_path: Path, swarm: Swarm, dashboard: tuple[str, subprocess.Popen[bytes]]
) -> None:
    url, proc = dashboard
    driver = browser()
    try:
        cfg = write_config(tmp_path, text_path(), max_steps=30)
        master = swarm.master(cfg, "--no-train")
        wait_until(lambda: swarm.outer_step() >= 0, what="the master's first global")
        nan_delta(swarm.bus_dir, "h1", swarm.outer_step())
        swarm.worker(cfg, "w1"), swarm.worker(cfg, "w2")
        driver.get(url)
        wait_until(lambda: cells(driver), 120, "the node table")  # live, while the swarm trains
        summary = swarm.result(master, 600)
        status = swarm.cli("hub", "status", swarm.repo)
        assert status["outer_step"] == summary["outer_step"] > 0
        wait_until(lambda: chart_last_step(driver) == status["outer_step"], 60, "the chart at the last step")
        keys = ("applied", "rejected", "tokens", "tokens_claimed", "lag", "pending_count", "quarantined")
        expected = {c["node"]: {k: c.get(k) for k in keys} for c in status["collaborators"]}

        def table() -> dict[str, dict[str, Any]]:
            return {node: {k: row.get(k) for k in keys} for node, row in cells(driver).items()}

        wait_until(lambda: table() == expected, 30, f"the node table to equal hub status: {expected}")
        assert {c["node"] for c in status["collaborators"]} == {"h1", "w1", "w2"}
        assert cells(driver)["h1"]["rejected_by"] == ["finite"]  # the check's name, in the node's row
        rejected = text(driver, "table[data-table=rejected]")
        assert "h1/h1--00000000.safetensors" in rejected and "finite" in rejected
        assert expected["w1"]["tokens"] > 0 and expected["w1"]["tokens_claimed"] > 0
        driver.execute_script(  # the loss chart over time
            "[...document.querySelectorAll('button')].find(b => b.textContent === 'wall clock').click()"
        )
        wait_until(lambda: (chart_last_step(driver) or 0) > 1e9, 10, "the chart's x axis in Unix time")
        # The bus goes away: the page keeps its data and says how old it is, then recovers.
        shutil.move(swarm.bus_dir, tmp_path / "bus-away")
        badge = "#source-0 .badge"
        wait_until(lambda: "unreachable" in text(driver, badge), 30, "unreachable")
        assert set(cells(driver)) == {"h1", "w1", "w2"} and "manifest.json is missing" in text(
            driver, "#source-0"
        )
        shutil.move(tmp_path / "bus-away", swarm.bus_dir)
        wait_until(lambda: "live" in text(driver, badge), 30, "live again")
        severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert severe == [], severe
        shots = [tmp_path / "dashboard-swarm.png"]
        driver.save_screenshot(str(shots[0]))
        driver.set_window_size(390, 844)  # a phone
        time.sleep(0.5)
        overflow = driver.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone's screen"
        shots.append(tmp_path / "dashboard-swarm-phone.png")
        driver.save_screenshot(str(shots[1]))
        assert all(shot.stat().st_size > 10_000 for shot in shots)
        if os.environ.get("SPEEDTRONIC_SCREENSHOTS"):
            for shot in shots:
                shutil.copy(shot, Path(os.environ["SPEEDTRONIC_SCREENSHOTS"]) / shot.name)
        assert proc.poll() is None  # the dashboard outlived the swarm
    finally:
        driver.quit()
