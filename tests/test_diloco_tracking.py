"""The swarm in the user's trackers (diloco/master/tracking.py): a real master and worker (the CLI, on a
directory bus) with `logging.hooks: [jsonl, tensorboard, wandb]`. The master's TensorBoard event file,
read back with TensorBoard's own reader, holds the global val loss of every outer step (the same values
as the master's `--json`); its W&B run (offline: WANDB_MODE=offline, and W&B's server pointed at a
closed loopback port, so nothing can phone home) holds them too, read back from the run's .wandb file;
the worker's runs say which node of which run they are. No secret in the environment (a W&B key, an
HF token) ends up in any file the swarm wrote.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from swarm_harness import TEXT, Swarm, write_config

pytestmark = pytest.mark.slow

WANDB_KEY = "wandbsecret" + "7" * 29  # 40 characters, as a W&B key
HF_TOKEN = "hf_trackingsecret" + "x" * 20


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file (run-*.wandb): a LevelDB-style log of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_history(folder: Path) -> tuple[Any, list[dict[str, Any]]]:
    """(the run record, the logged rows) of the one offline W&B run under `folder`/wandb."""
    files = list((folder / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    run, rows = None, []
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            rows.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
    return run, rows


@pytest.mark.parametrize("trains", [False, True], ids=["aggregates", "trains"])
def test_master_logs_the_swarm_to_tensorboard_and_wandb(tmp_path: Path, swarm: Swarm, trains: bool) -> None:
    """`trains`: the master also trains, as node "master": two W&B runs in its one process."""
    pytest.importorskip(
        "tensorboard", reason="the tensorboard extra is not installed (pip install -e '.[dev]')"
    )
    pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[dev]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    # Training, the master's own node needs w1's deltas too (min_deltas 2): alone it finished the run
    # before w1 had started under CI's load, and w1's scalars were never logged.
    cfg = write_config(
        tmp_path,
        TEXT if TEXT.exists() else None,
        max_steps=15,
        min_deltas=2 if trains else 1,
        master_trains=trains,
    )
    doc = yaml.safe_load(cfg.read_text())
    doc["run"]["output_dir"] = str(out)
    doc["logging"]["hooks"] = ["jsonl", "tensorboard", "wandb"]
    cfg.write_text(yaml.safe_dump(doc))
    env = {
        "WANDB_MODE": "offline",
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # a closed port: any call home fails here, never leaves
        "WANDB_API_KEY": WANDB_KEY,
        "HF_TOKEN": HF_TOKEN,
        **{f"WANDB_{d}_DIR": str(tmp_path / f"wandb-{d.lower()}") for d in ("CONFIG", "CACHE", "DATA")},
    }
    master = swarm.master(cfg, env=env)
    worker = swarm.worker(cfg, "w1", env=env)
    rm, rw = swarm.result(master), swarm.result(worker)
    assert rw["node"] == "w1" and rm["outer_step"] >= 3, rm
    losses = {e["outer_step"]: e["val_loss"] for e in rm["global_val_loss"]}
    assert sorted(losses) == list(range(rm["outer_step"] + 1)), losses  # every outer step, from 0

    # TensorBoard: the master's event file, read back with TensorBoard's reader.
    tb = EventAccumulator(str(out / "diloco-master" / "tensorboard"), size_guidance={"scalars": 0})
    tb.Reload()
    logged = {e.step: e.value for e in tb.Scalars("swarm/val_loss")}
    assert sorted(logged) == sorted(losses), (logged, losses)
    assert all(abs(logged[s] - losses[s]) < 1e-5 for s in losses), (logged, losses)
    assert tb.Scalars("swarm/node/w1/tokens")[-1].value == rm["per_node"]["w1"]["applied"] * 5 * 8 * 64
    assert tb.Scalars("swarm/applied")[-1].value == len(rm["applied"])
    assert tb.Scalars("swarm/bytes_in")[-1].value == rm["bytes_in"] > 0
    assert "swarm/wait_s" in tb.Tags()["scalars"] and "swarm/closed_by/text_summary" in tb.Tags()["tensors"]
    node_tb = EventAccumulator(str(out / "w1" / "tensorboard"))
    node_tb.Reload()
    text = node_tb.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "node:w1" in text and "group dl" in text, text

    # W&B, offline: the master's run and the worker's, read back from their run files.
    run, rows = wandb_history(out / "diloco-master")
    assert (run.display_name, run.run_group) == ("dl-swarm", "dl") and "swarm" in run.tags
    wandb_losses = {r["_step"]: r["swarm/val_loss"] for r in rows if "swarm/val_loss" in r}
    assert sorted(wandb_losses) == sorted(losses), (wandb_losses, losses)
    assert {r.get("swarm/closed_by") for r in rows} & {"all", "min_deltas", "grace", "max_wait"}, rows
    node_run, node_rows = wandb_history(out / "w1")
    assert (node_run.display_name, node_run.run_group) == ("dl-w1", "dl"), node_run
    assert {"node:w1", "role:worker"} <= set(node_run.tags) and any("train/loss" in r for r in node_rows)
    if trains:  # the master's own node: its run, beside the swarm's, in the same process
        own, own_rows = wandb_history(out / "master")
        assert own.display_name == "dl-master" and "role:master" in own.tags
        assert any("train/loss" in r for r in own_rows)

    # JSONL: one outer_step event per outer step in the master's metrics.jsonl.
    events = [json.loads(line) for line in (out / "diloco-master" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in events if e["event"] == "outer_step") == sorted(losses)

    # No secret in any file the swarm wrote (trackers, logs, configs, checkpoints, the bus).
    for path in tmp_path.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert WANDB_KEY.encode() not in data and HF_TOKEN.encode() not in data, path
