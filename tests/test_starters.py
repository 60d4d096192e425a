"""Starter configs ship inside the package: a name trains from any directory, `init` writes a commented
copy that loads to the same config, `configs` lists them, and the clone's configs/ stays in step."""

from __future__ import annotations

import json
from pathlib import Path

from speedtronic.config import load_config
from speedtronic.config.init_copy import commented_copy
from speedtronic.starters import starter_name, starters

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ROOT / "src" / "speedtronic" / "resources" / "configs"


def test_the_clone_configs_are_the_packaged_ones() -> None:
    clone = {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "configs").glob("*.yaml")}
    packaged = {p.name: p.read_text(encoding="utf-8") for p in PACKAGED.glob("*.yaml")}
    assert clone == packaged, "configs/ and src/speedtronic/resources/configs/ must hold the same files"
    assert {"shakespeare", "smoke"} <= set(starters())


def test_package_data_ships_the_configs() -> None:
    assert '"resources/configs/*.yaml"' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_names_resolve_but_an_existing_file_wins(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert starter_name("smoke") == starter_name("smoke.yaml") == "smoke"
    assert starter_name("configs/smoke.yaml") == "smoke"  # the clone's README path, outside the clone
    assert starter_name("elsewhere/smoke.yaml") is None
    assert load_config("smoke").run.name == "smoke"
    Path("smoke.yaml").write_text("run: {name: mine, max_steps: 3}\n", encoding="utf-8")
    assert starter_name("smoke.yaml") is None
    assert load_config("smoke.yaml").run.name == "mine"


def test_every_commented_copy_loads_to_the_shipped_config(tmp_path: Path) -> None:
    for name in starters():
        copy = tmp_path / f"{name}.yaml"
        copy.write_text(commented_copy(name), encoding="utf-8")
        assert load_config(copy) == load_config(PACKAGED / f"{name}.yaml"), name
    text = commented_copy("shakespeare")
    assert "max_steps: 600" in text and "# Optimizer steps to train for." in text


def test_train_a_shipped_config_by_name_outside_the_clone(run_cli, tmp_path: Path) -> None:
    out = run_cli("train", "smoke", "--max-steps", "2", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["steps"] == 2
    assert (tmp_path / "runs" / "smoke" / "metrics.jsonl").is_file()


def test_init_writes_a_copy_and_refuses_to_overwrite(run_cli, tmp_path: Path) -> None:
    first = run_cli("init", "smoke", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1])["path"] == "smoke.yaml"
    assert load_config(tmp_path / "smoke.yaml") == load_config(PACKAGED / "smoke.yaml")
    again = run_cli("init", "smoke")
    assert again.returncode == 2 and "--force" in again.stderr
    (tmp_path / "sub").mkdir()
    assert run_cli("init", "smoke", "sub").returncode == 0
    assert (tmp_path / "sub" / "smoke.yaml").is_file()
    unknown = run_cli("init", "nope")
    assert unknown.returncode == 2 and "shakespeare" in unknown.stderr


def test_configs_lists_them(run_cli) -> None:
    out = run_cli("configs", "--json")
    assert out.returncode == 0, out.stderr
    listed = {item["name"]: item for item in json.loads(out.stdout.splitlines()[-1])["configs"]}
    assert listed.keys() == starters().keys()
    assert listed["hf-gpt2"]["needs_plugin"] == "speedtronic-transformers"
    assert listed["smoke"]["needs_plugin"] is None


def test_a_missing_config_names_the_shipped_ones(run_cli) -> None:
    out = run_cli("validate", "nope.yaml")
    assert out.returncode == 2
    assert "not found" in out.stderr and "shakespeare" in out.stderr
