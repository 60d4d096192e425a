"""Make the dashboard screenshots in the docs from real runs (docs/images/dashboard-*.png).

    python scripts/dashboard_screens.py [--out docs/images] [--work DIR]

1. A runs folder: three short trainings on the embedded Shakespeare corpus (AdamW at two learning
   rates, Muon), each evaluated with the shipped `shakespeare` task suite: `dashboard-runs.png`.
2. A swarm: a master and two workers on a directory bus (each worker evaluating its own model), and a
   peer whose one delta is NaN (the master's `finite` check refuses it): `dashboard-swarm.png` while
   it trains and once it ended, and `dashboard-swarm-phone.png` at a phone's width.

Each picture is the page `speedtronic dashboard` serves, taken by headless Chromium (selenium with
Debian's `chromium` and `chromium-driver`: `apt-get install -y chromium chromium-driver`,
`pip install selenium`). Takes a few minutes on a laptop CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
}
ENV.pop("HF_TOKEN", None)
RUNS = {  # name -> --set overrides of the shipped shakespeare config
    "adamw-lr2e-3": ["optimizer.lr=2e-3"],
    "adamw-lr6e-3": ["optimizer.lr=6e-3"],
    "muon-lr2e-3": ["optimizer.name=muon", "optimizer.lr=2e-3"],
}
SMALL = ["model.n_layer=2", "model.d_model=64", "run.max_steps=150", "run.eval_every=25", "run.log_every=10"]


def speedtronic(*args: str, cwd: Path, **kw: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "speedtronic", *args], cwd=cwd, env=ENV, **kw)


def train_runs(work: Path) -> Path:
    for name, sets in RUNS.items():
        args = [
            f"run.name={name}",
            f"run.output_dir={work / 'trainings' / name}",
            "run.eval_tasks=[shakespeare]",
        ]
        proc = speedtronic("train", "shakespeare", *(f"--set={s}" for s in [*SMALL, *sets, *args]), cwd=work)
        assert proc.wait() == 0, f"training {name} failed"
    return work / "trainings"


def swarm_config(work: Path) -> Path:
    cfg = {
        "run": {"name": "swarm", "max_steps": 120, "log_every": 10, "eval_every": 10, "device": "cpu"},
        "model": {"n_layer": 2, "n_head": 2, "d_model": 64},
        "data": {"block_size": 64, "micro_batch_size": 8, "val_batches": 4},
        "optimizer": {"lr": 3.0e-3},
        "checkpoint": {"every_steps": 10, "keep_last": 2},
        "logging": {"hooks": ["jsonl"]},
        "distributed": {"enabled": True, "sync": {"inner_steps": 10}, "node": {"poll_interval": 0.5}},
    }
    path = work / "swarm.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def nan_delta(bus: Path, node: str) -> None:
    """One well-formed delta of NaNs from `node` (final: the master waits for no more from it)."""
    import torch

    from speedtronic.diloco import codec
    from speedtronic.diloco.bus.directory import DirectoryBus

    directory = DirectoryBus(str(bus))
    manifest, head = directory.read_manifest(), directory.read_head()
    assert manifest is not None and head is not None
    specs = codec.specs_from_json(manifest["params"])
    meta = {"kind": "delta", "node": node, "seq": "0", "local_step": "10", "tokens": "5120", "final": "1"}
    meta["base_outer_step"] = str(head["outer_step"])
    tensors = {n: torch.full(s.shape, float("nan")) for n, s in specs.items()}
    directory.put_delta(node, codec.delta_name(node, 0), codec.encode(tensors, "fp32", meta))


def browser(width: int, height: int) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def dashboard(work: Path, *sources: str) -> tuple[subprocess.Popen[bytes], str]:
    out = work / f"dashboard-{len(list(work.glob('dashboard-*.out')))}.out"
    proc = speedtronic(
        "dashboard", *sources, "--port", "0", "--interval", "1", cwd=work, stdout=out.open("wb")
    )
    for _ in range(600):
        if out.read_text().strip():
            return proc, out.read_text().split()[-1]
        time.sleep(0.1)
    raise RuntimeError("the dashboard printed no URL")


def shoot(url: str, path: Path, width: int = 1280, height: int = 800, settle: float = 4.0) -> None:
    driver = browser(width, height)
    try:
        driver.get(url)
        time.sleep(settle)  # two or three polls: every chart drawn
        height = driver.execute_script("return document.documentElement.scrollHeight")
        chrome = driver.execute_script("return window.outerHeight - window.innerHeight")
        driver.set_window_size(width, min(max(height, 800), 2400) + chrome)  # the whole page in one picture
        time.sleep(1.0)
        driver.save_screenshot(str(path))
    finally:
        driver.quit()
    print(f"wrote {path}")


def run_swarm(work: Path, out: Path) -> None:
    cfg, bus = swarm_config(work), work / "bus"
    url_of_bus = f"file://{bus}"
    master = speedtronic("master", str(cfg), "--repo", url_of_bus, "--no-train", cwd=work)
    while not (bus / "head.json").exists():
        time.sleep(0.2)
    nan_delta(bus, "h1")
    workers = [
        speedtronic("worker", str(cfg), "--repo", url_of_bus, "--node-id", n, cwd=work) for n in ("w1", "w2")
    ]
    server, url = dashboard(work, url_of_bus)
    try:
        for proc in workers:  # they end at the run's last outer step; the master then waits for late joiners
            assert proc.wait(900) == 0, "a worker failed"
        time.sleep(3)
        assert master.poll() is None, "the master stopped"
        shoot(url, out / "dashboard-swarm.png")
        shoot(url, out / "dashboard-swarm-phone.png", width=390, height=844)
    finally:
        server.kill()
        for proc in (master, *workers):
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--work", type=Path, default=None, help="Keep the runs and the bus here.")
    parser.add_argument("--only", choices=("swarm", "runs"), default=None, help="Make one picture's part.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="dashboard-screens-"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    if args.only in (None, "swarm"):
        run_swarm(work, args.out.resolve())
    if args.only == "swarm":
        return
    runs = work / "trainings" if (work / "trainings").is_dir() else train_runs(work)  # kept from a run before
    server, url = dashboard(work, str(runs))
    try:
        shoot(url, args.out.resolve() / "dashboard-runs.png")
    finally:
        server.kill()


if __name__ == "__main__":
    main()
