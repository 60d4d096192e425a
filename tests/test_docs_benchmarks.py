"""docs/benchmarks.md is generated from bench/results/ by scripts/gen_benchmarks.py, and is fresh.

- Fresh: the committed page equals what the script writes now, so a result file added or changed
  without regenerating fails here (the fix: `python scripts/gen_benchmarks.py`).
- Read from the files: a changed figure in a result file changes the page's table and ratio.
- `--check` reports a stale page and writes nothing.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_benchmarks", ROOT / "scripts" / "gen_benchmarks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_benchmarks = _load_generator()


def test_the_committed_page_is_fresh() -> None:
    committed = gen_benchmarks.PAGE.read_text(encoding="utf-8")
    assert committed == gen_benchmarks.render(), (
        "docs/benchmarks.md is stale (bench/results/ or the generator changed); "
        "run: python scripts/gen_benchmarks.py"
    )


def test_the_page_is_in_the_site_nav() -> None:
    assert "benchmarks.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_a_changed_result_changes_the_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    before = gen_benchmarks.render()
    assert "| 30 Mbit/s | 49.1 / 162.1 | 9.3 / 9.4 |" in before
    run = json.loads((results / "wan-30-poll.json").read_text())
    run["ddp_s_to_target"] = run["diloco_s_to_target"] * 10
    (results / "wan-30-poll.json").write_text(json.dumps(run))
    monkeypatch.setattr(gen_benchmarks, "RESULTS", results)
    after = gen_benchmarks.render()
    assert "| 30 Mbit/s | 93.1 / 162.1 | 9.3 / 9.4 | 22.0 / 29.1 | 2.8 | **10×** |" in after


def test_check_reports_a_stale_page_and_writes_nothing(tmp_path: Path) -> None:
    page = tmp_path / "benchmarks.md"
    assert gen_benchmarks.main(["--check", "--out", str(page)]) == 1 and not page.exists()
    assert gen_benchmarks.main(["--out", str(page)]) == 0
    assert gen_benchmarks.main(["--check", "--out", str(page)]) == 0
    page.write_text("edited by hand\n")
    assert gen_benchmarks.main(["--check", "--out", str(page)]) == 1
