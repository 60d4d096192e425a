"""manifest.json and head.json parse into typed documents; a hostile field is one clear error."""

from __future__ import annotations

import pytest
import torch

from speedtronic.config import load_config
from speedtronic.diloco import codec
from speedtronic.diloco.documents import DocumentError, HeadDoc, Manifest
from speedtronic.diloco.manifest import add_collaborator, build_manifest

SPECS = {"w": codec.ParamSpec((4, 3), "float32"), "b": codec.ParamSpec((3,), "float32")}


@pytest.fixture
def manifest() -> dict:
    config = load_config("smoke", [])
    return add_collaborator(build_manifest(config, SPECS), "w1", "alice")


def test_a_built_manifest_parses_and_round_trips(manifest: dict) -> None:
    doc = Manifest.parse(manifest)
    assert doc.specs() == SPECS
    assert doc.run.inner_steps == manifest["run"]["inner_steps"]
    assert doc.collaborators["w1"].user == "alice"
    assert doc.to_json() == manifest


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("params", "w", "shape"), ["x", 3], "params.w.shape.0"),
        (("params", "w", "shape"), [-4, 3], "params.w.shape"),
        (("run", "outer_steps"), "many", "run.outer_steps"),
        (("run", "inner_steps"), 0, "run.inner_steps"),
        (("format",), None, "format"),
        (("params", "w", "dtype"), "float99", "params.w.dtype"),
        (("params", "w", "dtype"), "int64", "params.w.dtype"),
        (("params", "w", "shape"), [1 << 30, 1 << 30, 2], "params.w.shape"),
        (("run", "outer_lr"), float("nan"), "run.outer_lr"),
        (("run", "outer_momentum"), float("inf"), "run.outer_momentum"),
        (("run", "delta_codec"), "zip", "run.delta_codec"),
        (("params",), [{"shape": [4, 3], "dtype": "float32"}], "params"),
        (("collaborators",), ["w1"], "collaborators"),
        (("run",), [1], "run"),
    ],
)
def test_a_tampered_manifest_names_the_field(manifest: dict, path: tuple, value: object, field: str) -> None:
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(DocumentError, match=rf"manifest.json: field {field} is invalid"):
        Manifest.parse(manifest)


def test_a_manifest_whose_params_do_not_match_its_fingerprint_is_refused(manifest: dict) -> None:
    manifest["params"]["w"]["dtype"] = "float16"  # a valid entry, but not the run's: decoding would misread
    with pytest.raises(
        DocumentError, match=r"field fingerprint is invalid \(it is not the fingerprint of params"
    ):
        Manifest.parse(manifest)


def test_a_manifest_with_a_path_for_a_node_id_is_refused(manifest: dict) -> None:
    manifest["collaborators"]["../etc"] = {"user": "x"}
    with pytest.raises(DocumentError, match="invalid node id"):
        Manifest.parse(manifest)


def test_a_head_parses_keeps_unknown_fields_and_refuses_a_bad_round() -> None:
    head = {"format": 1, "outer_step": 3, "global": "global/g-3.safetensors", "hwm": {"w1": 2}, "later": [1]}
    doc = HeadDoc.parse(head)
    assert (doc.outer_step, doc.global_, doc.hwm.get("w1"), doc.hwm.get("w2", -1)) == (
        3,
        head["global"],
        2,
        -1,
    )
    assert doc.to_json() == head
    with pytest.raises(DocumentError, match=r"head\.json: field fragments\.rounds\.1 is invalid"):
        HeadDoc.parse({**head, "fragments": {"count": 2, "rounds": [1, "abc"]}})
    with pytest.raises(DocumentError, match="expected a JSON object"):
        HeadDoc.parse(["not", "a", "head"])


def _directory_run(tmp_path, manifest: dict):
    from speedtronic.diloco.bus.registry import open_bus

    bus = open_bus(f"file://{tmp_path / 'bus'}")
    bus.create_run()
    bus.write_manifest(manifest)
    return bus


def test_a_joining_node_reads_a_tampered_manifest_as_one_error(tmp_path, manifest: dict) -> None:
    from speedtronic.diloco.launch import wait_for_manifest

    manifest["params"]["w"]["shape"] = ["4", "three"]
    bus = _directory_run(tmp_path, manifest)
    with pytest.raises(DocumentError, match=r"manifest\.json: field params\.w\.shape\.1 is invalid"):
        wait_for_manifest(bus, 1.0)


def test_a_worker_ignores_a_head_that_does_not_parse(tmp_path, manifest: dict, caplog) -> None:
    from speedtronic.diloco.spec import RunSpec
    from speedtronic.diloco.worker import Coordinator

    bus = _directory_run(tmp_path, manifest)
    weights = {name: torch.zeros(spec.shape) for name, spec in SPECS.items()}
    data = codec.encode(weights, "fp32", {"kind": "global", "outer_step": "1", "node": "master"})
    bus.publish(data, {"format": 1, "outer_step": 1, "hwm": {"w1": "many"}, "nodes": {}})
    config = load_config("smoke", [])
    worker = Coordinator(
        config, bus, "w1", Manifest.parse(manifest), spec=RunSpec.of_run(Manifest.parse(manifest), config)
    )
    assert worker.poller.read_head() is None and worker.poller.read_head() is None
    assert [r.message for r in caplog.records].count(
        next(r.message for r in caplog.records if "does not parse" in r.message)
    ) == 1  # once per head version
    assert "field hwm.w1 is invalid" in caplog.text
    worker.poller.poll_once()  # a poll that meets it installs nothing and raises nothing
    assert worker.poller.incoming is None and worker.fault.error is None
