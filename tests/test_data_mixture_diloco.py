"""A DiLoCo worker may train its own data mixture (node-local `--set data.sources=...`): the run's manifest
describes the model, not the data, so the worker joins; its delta is applied; and the master's loss probe
keeps scoring the run's own validation set."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.launch import build_reference, node_config
from speedtronic.diloco.manifest import build_manifest
from speedtronic.diloco.master import Master
from speedtronic.diloco.node_eval import Evaluator
from speedtronic.diloco.worker import Coordinator

pytestmark = pytest.mark.usefixtures("isolated_env")

BASE = [
    "run.device=cpu",
    "run.eval_every=0",
    "run.log_every=1",
    "logging.hooks=[]",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "data.block_size=16",
    "data.micro_batch_size=4",
    "data.val_batches=2",
    "optimizer.lr=1.0e-2",
    "checkpoint.enabled=false",
    "distributed.enabled=true",
    "distributed.sync.inner_steps=2",
    "distributed.sync.ramp=false",
    "distributed.sync.delta_codec=fp32",
    "distributed.node.poll_interval=0.05",
    "distributed.rounds.max_wait=5",
    "distributed.rounds.min_deltas=1",
    "distributed.worker.async_upload=false",
    "distributed.worker.async_global_poll=false",
    "distributed.sync.overlap_steps=0",
]


def test_a_worker_trains_its_own_mixture_and_the_master_probes_the_runs_val_set(tmp_path: Path) -> None:
    (tmp_path / "run.txt").write_text("".join(f"the run's own text, line {i}\n" for i in range(400)))
    (tmp_path / "web.txt").write_text("".join(f"a web page, number {i}\n" for i in range(400)))
    (tmp_path / "code.txt").write_text("".join(f"x{i} = f({i})\n" for i in range(400)))
    run = load_config(
        None, [*BASE, f"run.output_dir={tmp_path / 'out'}", f"data.text_path={tmp_path / 'run.txt'}"]
    )
    mixture = f"[{{path: {tmp_path / 'web.txt'}, weight: 3}}, {{path: {tmp_path / 'code.txt'}, weight: 1}}]"
    local = load_config(None, [*BASE, f"run.output_dir={tmp_path / 'out'}", f"data.sources={mixture}"])
    worker_cfg = node_config(local, "w1", "worker")
    assert [s.key for s in worker_cfg.data.sources] == ["web", "code"]

    reference = build_reference(run)
    bus = DirectoryBus(str(tmp_path / "bus"))
    bus.create_run()
    manifest = build_manifest(run, codec.param_specs(reference.model))
    bus.write_manifest(manifest)
    master = Master(
        run, bus, manifest, codec.snapshot(reference.model), state_dir=tmp_path / "state", momentum=0.0
    )
    master.start_state()

    coordinator = Coordinator(worker_cfg, bus, "w1", manifest)  # joins: the model is the run's
    result = Trainer(worker_cfg, sync=coordinator, progress=False).train(max_steps=2)
    assert set(result.data_sources or {}) == {"web", "code"}
    assert coordinator.uploaded
    for _ in range(50):
        if master.round():
            break
    assert master.outer_step == 1 and master.applied and not master.rejected

    # The master's probe (node_eval.Evaluator over the reference's bundle) scores the run's validation
    # set, cut from run.txt, whatever the workers train on.
    evaluator = Evaluator.for_run(run, reference.model, reference.bundle, reference.plan)
    assert evaluator is not None and evaluator.batches
    text = "".join(bytes(row.tolist()).decode() for b in evaluator.batches for row in b["input_ids"])
    assert "own text, line" in text and "web page" not in text
