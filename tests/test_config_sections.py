"""The config reads by concern: no section has more than 20 fields, `distributed` is subsections, and
configs written with the old flat `distributed.*` keys still load and train, one warning per key.

# codemod_distributed: skip  (this file writes the old flat keys on purpose)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from speedtronic.config import Config, load_config
from speedtronic.config.distributed import MOVED, SUBSECTIONS, DistributedConfig, migrate_flat_keys, moved_key
from speedtronic.config.schema import SECTIONS
from speedtronic.errors import ConfigError

pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

MAX_FIELDS = 20

# A DiLoCo master that trains, on a directory bus, written the way configs were before the subsections.
OLD_FLAT = """\
run: {name: old-flat, max_steps: 4, log_every: 2, eval_every: 0, device: cpu}
model: {n_layer: 1, n_head: 2, d_model: 32}
data: {synthetic: true, vocab_size: 64, block_size: 16, micro_batch_size: 2, val_batches: 1}
checkpoint: {enabled: false}
logging: {hooks: []}
distributed:
  enabled: true
  repo_id: file://bus
  node_id: master
  inner_steps: 2
  poll_interval: 0.2
  max_wait: 30.0
  min_deltas: 1
  retry_initial: 0.2
  retry_max: 1.0
  late_join_wait: 0.0
  sync_ramp: false
"""
OLD_KEYS = [k for k in yaml.safe_load(OLD_FLAT)["distributed"] if k in MOVED]


def models_under(model: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel]]]:
    """Every pydantic model reachable from `model`'s fields (a section, a subsection), with its path."""
    found = [(path, model)]
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += models_under(annotation, f"{path}.{name}" if path else name)
    return found


def test_no_config_section_has_more_than_20_fields() -> None:
    sections = models_under(Config, "")
    sections += [(name, cls) for name, cls in SECTIONS.items()]  # the default model's own section
    assert {path for path, _ in sections} >= {f"distributed.{s}" for s in SUBSECTIONS}
    crowded = {path or "<root>": len(cls.model_fields) for path, cls in sections}
    assert all(count <= MAX_FIELDS for count in crowded.values()), crowded
    assert len(DistributedConfig.model_fields) == 3 + len(SUBSECTIONS)  # strategy, enabled, mode


def test_every_old_key_has_a_new_place_that_exists() -> None:
    for old, (section, name) in MOVED.items():
        sub = DistributedConfig.model_fields[section].annotation
        assert name in sub.model_fields, f"distributed.{old} -> {section}.{name}"  # type: ignore[union-attr]
    assert len(MOVED) == len({v for v in MOVED.values()})  # no two old keys land on one field


def test_old_flat_keys_land_in_their_new_place() -> None:
    old = load_config({"distributed": yaml.safe_load(OLD_FLAT)["distributed"]})
    new = load_config(
        {
            "distributed": {
                "enabled": True,
                "bus": {"repo_id": "file://bus", "retry_initial": 0.2, "retry_max": 1.0},
                "node": {"id": "master", "poll_interval": 0.2},
                "sync": {"inner_steps": 2, "ramp": False},
                "rounds": {"max_wait": 30.0, "min_deltas": 1, "late_join_wait": 0.0},
            }
        }
    )
    assert old == new
    assert old.distributed.sync.inner_steps == 2 and old.distributed.node.id == "master"


def test_set_with_an_old_key_lands_in_the_new_place_and_wins_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "new.yaml"
    path.write_text("distributed: {sync: {inner_steps: 10}}\n", encoding="utf-8")
    assert load_config(path, ["distributed.inner_steps=3"]).distributed.sync.inner_steps == 3
    old = tmp_path / "old.yaml"
    old.write_text("distributed: {inner_steps: 10}\n", encoding="utf-8")
    assert load_config(old, ["distributed.sync.inner_steps=4"]).distributed.sync.inner_steps == 4
    assert load_config(old, ["distributed.inner_steps=5"]).distributed.sync.inner_steps == 5
    assert moved_key("distributed.fsdp_cpu_offload") == "distributed.fsdp.cpu_offload"
    assert moved_key("distributed.sync.inner_steps") == "distributed.sync.inner_steps"
    assert moved_key("optimizer.lr") == "optimizer.lr"


def test_old_and_new_key_together_is_an_error_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("distributed: {inner_steps: 10, sync: {inner_steps: 20}}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "distributed.inner_steps" in str(caught.value)
    assert "distributed.sync.inner_steps" in str(caught.value)
    with pytest.raises(ValueError, match=r"distributed\.node_id and distributed\.node\.id"):
        DistributedConfig.model_validate({"node_id": "a", "node": {"id": "b"}})  # a stored config too
    with pytest.raises(ConfigError, match=r"distributed\.token and distributed\.bus\.token"):
        migrate_flat_keys({"token": "x", "bus": {"token": "y"}})


def test_a_misspelt_old_key_suggests_the_new_one() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'distributed\.sync\.inner_steps'"):
        load_config({"distributed": {"inner_stepz": 3}})


def test_an_old_flat_config_trains_with_one_warning_per_moved_key(run_cli, tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(OLD_FLAT, encoding="utf-8")
    # --set with an old key too: it is the same key, warned about once
    out = run_cli("master", path, "--set", "distributed.max_wait=25", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["train"]["steps"] == 4 and result["outer_step"] == 2
    warned = [line for line in out.stderr.splitlines() if re.search(r"distributed\.\w+ is now", line)]
    assert sorted(re.search(r"distributed\.(\w+) is now", line)[1] for line in warned) == sorted(OLD_KEYS)
    for line in warned:
        old = re.search(r"distributed\.(\w+) is now", line)[1]
        assert "distributed.{}.{}".format(*MOVED[old]) in line


def test_validate_shows_the_new_form(run_cli, tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(OLD_FLAT, encoding="utf-8")
    out = run_cli("validate", path, "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout.splitlines()[-1])["config"]["distributed"]
    assert not set(shown) & set(MOVED)
    assert set(shown) == {"strategy", "enabled", "mode", *SUBSECTIONS}
    assert shown["sync"]["inner_steps"] == 2 and shown["bus"]["repo_id"] == "file://bus"
    new = tmp_path / "new.yaml"
    new.write_text(run_cli("validate", path, cwd=tmp_path).stdout, encoding="utf-8")
    again = run_cli("validate", new, "--json", cwd=tmp_path)
    assert again.returncode == 0 and "is now" not in again.stderr, again.stderr  # the new form: no warning


def test_old_and_new_key_together_exits_2(run_cli, tmp_path: Path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("distributed: {node_id: a, node: {id: b}}\n", encoding="utf-8")
    out = run_cli("validate", path, cwd=tmp_path)
    assert out.returncode == 2
    assert "distributed.node_id" in out.stderr and "distributed.node.id" in out.stderr


@pytest.mark.parametrize("key", ["distributed.node.lease_s", "distributed.master.lease_s"])
@pytest.mark.parametrize("value", ["1e-9", "0", ".inf", ".nan", "1e9"])
def test_a_lease_outside_a_second_to_a_week_names_the_field(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config("smoke", [f"{key}={value}"])
    assert load_config("smoke", [f"{key}=30"]).distributed.node.lease_s > 0
