"""RunSpec: one description of the run, the same whether built from the config or read back from the manifest."""

from __future__ import annotations

from speedtronic.config import load_config
from speedtronic.diloco import codec
from speedtronic.diloco.documents import Manifest
from speedtronic.diloco.manifest import build_manifest
from speedtronic.diloco.spec import RunSpec

SPECS = {f"layer{i}.w": codec.ParamSpec((8, 4), "float32") for i in range(4)}


def _config(*sets: str):
    return load_config("smoke", ["distributed.sync.inner_steps=5", "run.max_steps=40", *sets])


def test_the_manifest_and_the_spec_say_the_same() -> None:
    config = _config()
    spec = RunSpec.from_config(config, SPECS)
    run = build_manifest(config, SPECS)["run"]
    assert (spec.outer_steps, spec.max_delta_tokens) == (run["outer_steps"], run["max_delta_tokens"])
    assert (spec.outer_lr, spec.outer_momentum) == (run["outer_lr"], run["outer_momentum"])
    assert spec.sync_points(40) == [5, 10, 15, 20, 25, 30, 35, 40]
    assert spec.max_global_bytes == int(1.5 * codec.wire_bytes(SPECS, "fp32")) + (1 << 20)


def test_a_node_reads_the_run_from_its_manifest_not_its_own_config() -> None:
    manifest = Manifest.parse(build_manifest(_config(), SPECS))
    mine = RunSpec.of_run(manifest, _config("distributed.sync.outer_lr=0.3", "run.max_steps=400"))
    assert mine.outer_steps == 8 and mine.outer_lr == manifest.run.outer_lr
    assert mine.fingerprint == codec.fingerprint(SPECS) and dict(mine.specs) == SPECS


def test_an_older_manifest_falls_back_to_the_config() -> None:
    raw = build_manifest(_config(), SPECS)
    for key in ("max_delta_tokens", "outer_steps", "tokens_per_step"):
        raw["run"].pop(key)
    spec = RunSpec.of_run(Manifest.parse(raw), _config())
    assert spec.outer_steps is None
    assert spec.max_delta_tokens == RunSpec.from_config(_config(), SPECS).max_delta_tokens


def test_streaming_fragments_split_the_sync_points() -> None:
    spec = RunSpec.from_config(_config("distributed.sync.fragments=2"), SPECS)
    assert spec.fragments.count == 2
    assert len(spec.sync_points(40)) == spec.outer_steps
