"""The worker coordinator inside a real Trainer on a real directory bus: the sign and exactness of the
pseudo-gradient, a failed upload keeping its baseline, the upload queue's overflow policies, its state
in the training checkpoint, and the CLI's fail-fast refusals (fingerprint, permissions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.manifest import build_manifest
from speedtronic.diloco.master import Master
from speedtronic.diloco.worker import Coordinator
from speedtronic.diloco.worker.upload_item import Item
from speedtronic.engine.build import build_model

pytestmark = pytest.mark.usefixtures("isolated_env")

BASE = [
    "run.device=cpu",
    "run.eval_every=0",
    "run.log_every=1",
    "logging.hooks=[]",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "data.synthetic=true",
    "data.vocab_size=64",
    "data.num_tokens=20000",
    "data.block_size=16",
    "data.micro_batch_size=4",
    "data.val_batches=0",
    "optimizer.lr=1.0e-2",
    "distributed.enabled=true",
    "distributed.sync.inner_steps=2",
    "distributed.sync.ramp=false",
    "distributed.sync.delta_codec=fp32",
    "distributed.node.poll_interval=0.05",
    "distributed.bus.retry_initial=0.05",
    "distributed.bus.retry_max=0.1",
    "distributed.rounds.max_wait=5",
    # The worker never waits for a global here: these tests step the master themselves, between
    # train() calls (overlap_steps 1, the shipped value, would wait max_wait for it at every sync).
    "distributed.sync.overlap_steps=0",
]


def setup_run(tmp_path: Path, *extra: str):
    cfg = load_config(None, [*BASE, f"run.output_dir={tmp_path / 'out'}", *extra])
    torch.manual_seed(0)
    model = build_model(cfg, 64)
    bus = DirectoryBus(str(tmp_path / "bus"))
    bus.create_run()
    manifest = build_manifest(cfg, codec.param_specs(model))
    bus.write_manifest(manifest)
    master = Master(cfg, bus, manifest, codec.snapshot(model), state_dir=tmp_path / "state", momentum=0.0)
    master.start_state()
    return cfg, bus, manifest, master


def bus_deltas(bus: DirectoryBus, specs: dict[str, codec.ParamSpec]) -> list[codec.Decoded]:
    return [
        codec.decode(bus.get_delta(ref, 1 << 30), specs, kind="delta")
        for ref in sorted(bus.list_deltas(None), key=lambda r: r.name)
    ]


def block_uploads(bus: DirectoryBus, node: str) -> Path:
    """A file where the node's delta directory should be: every upload fails (a real OSError)."""
    blocker = bus.root / "deltas" / node
    blocker.write_bytes(b"")
    return blocker


def test_a_failed_upload_keeps_its_baseline_so_the_next_delta_is_cumulative(tmp_path: Path) -> None:
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",
        "distributed.worker.async_global_poll=false",
        "distributed.worker.upload_shutdown_timeout=0.3",  # the first train() ends with a short flush
    )
    global0 = {n: t.clone() for n, t in master.outer.weights.items()}
    blocker = block_uploads(bus, "w1")
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    trainer = Trainer(cfg, sync=coordinator, progress=False)
    trainer.train(max_steps=4)  # boundaries at steps 2 and 4: both uploads fail
    assert coordinator.uploaded == [] and len(coordinator.uploader.queue) == 1  # merged, not queued twice
    blocker.unlink()
    trainer.train(max_steps=6)  # stop/start again: the step-6 delta carries steps 1–6
    assert coordinator.uploaded == ["w1--00000002.safetensors"]
    (delta,) = bus_deltas(bus, codec.specs_from_json(manifest["params"]))
    now = codec.snapshot(trainer.raw_model)
    for name, d in delta.tensors.items():
        # Δ = θ_global_at_sync − θ_now, exactly (fp32 codec), nothing lost to the failures
        assert torch.allclose(d, global0[name] - now[name], atol=1e-6), name
    assert delta.int("tokens") == trainer.tokens_seen and delta.meta["base_outer_step"] == "0"


def test_coordinator_state_survives_a_checkpoint_resume(tmp_path: Path) -> None:
    extra = [
        "checkpoint.every_steps=2",
        "distributed.worker.upload_shutdown_timeout=0.3",
        "distributed.worker.async_global_poll=false",
    ]
    cfg, bus, manifest, master = setup_run(tmp_path, *extra)
    global0 = {n: t.clone() for n, t in master.outer.weights.items()}
    blocker = block_uploads(bus, "w1")
    first = Coordinator(cfg, bus, "w1", manifest)
    Trainer(cfg, sync=first, progress=False).train(max_steps=4)
    saved = first.state_dict()
    assert saved["queue"] and saved["seq"] == 2
    blocker.unlink()
    second = Coordinator(cfg, bus, "w1", manifest)
    trainer = Trainer(cfg, sync=second, progress=False)  # resumes from the step-4 checkpoint
    assert (
        trainer.step == 4 and second.numbering.seq == 2 and len(second.uploader.queue) == len(saved["queue"])
    )
    for name, t in saved["anchor"].items():
        assert torch.equal(second.book.anchor[name], t)
    trainer.train(max_steps=6)
    deltas = bus_deltas(bus, codec.specs_from_json(manifest["params"]))
    assert len(deltas) >= 1
    now = codec.snapshot(trainer.raw_model)
    for name in global0:
        total = sum(d.tensors[name] for d in deltas)
        assert torch.allclose(total, global0[name] - now[name], atol=1e-5), name


def _item(seq: int, value: float) -> Item:
    return Item(seq, {"w": torch.full((3,), value)}, base=0, local_step=seq, tokens=10)


@pytest.mark.parametrize("policy", ["drop_oldest", "coalesce"])
def test_upload_queue_overflow_policies(tmp_path: Path, policy: str) -> None:
    cfg, bus, manifest, _ = setup_run(
        tmp_path, "distributed.worker.upload_queue_size=1", f"distributed.worker.upload_overflow={policy}"
    )
    c = Coordinator(cfg, bus, "w1", manifest)
    head = _item(0, 1.0)
    head.in_flight = True  # the uploader holds it: it does not count against the queue size
    c.uploader.queue.extend([head])
    c.uploader.enqueue(_item(1, 2.0))
    c.uploader.enqueue(_item(2, 4.0))
    seqs = [i.seq for i in c.uploader.queue]
    if policy == "drop_oldest":
        assert seqs == [0, 2] and c.uploader.dropped == 1 and c.uploader.queue[1].x["w"][0] == 4.0
    else:
        assert seqs == [0, 2] and c.uploader.dropped == 0
        assert (
            c.uploader.queue[1].x["w"][0] == 6.0 and c.uploader.queue[1].tokens == 20
        )  # one cumulative delta


def test_worker_with_another_model_is_refused_with_the_reason(tmp_path: Path, run_cli) -> None:
    setup_run(tmp_path)
    config = tmp_path / "other.yaml"
    config.write_text("model: {n_layer: 1, n_head: 2, d_model: 64}\n", encoding="utf-8")
    sets = [a for s in BASE if not s.startswith("model.") for a in ("--set", s)]
    result = run_cli("worker", config, "--repo", f"file://{tmp_path / 'bus'}", "--node-id", "w9", *sets)
    assert result.returncode == 2, result.stderr  # a mismatch with the run's config is a usage error
    assert "does not match the run's model fingerprint" in result.stderr
    assert "is [64, 64] float32 here but [32, 32] float32 in the run" in result.stderr


def test_worker_fails_fast_naming_the_repo_and_the_missing_permission(tmp_path: Path, run_cli) -> None:
    from hub_server import HubServer

    server = HubServer()
    try:
        server.state.add_user("owner", "hf_ownerfailfast001")
        server.state.add_user("carol", "hf_carolreadonly002", role="read")
        server.state.add_user("dave", "hf_davenoaccess0003")
        from huggingface_hub import HfApi

        from speedtronic.diloco.bus.hub import HubBus
        from speedtronic.diloco.manifest import add_collaborator

        HfApi(endpoint=server.url, token="hf_ownerfailfast001").create_repo("owner/run", private=False)
        bus = HubBus("owner/run", endpoint=server.url, token="hf_ownerfailfast001")
        cfg = load_config(None, BASE)
        torch.manual_seed(0)
        manifest = build_manifest(cfg, codec.param_specs(build_model(cfg, 64)))
        manifest = add_collaborator(add_collaborator(manifest, "carol"), "dave")
        bus.write_manifest(manifest)
        HfApi(endpoint=server.url, token="hf_ownerfailfast001").update_repo_settings(
            "owner/run", gated="manual"
        )
        HfApi(endpoint=server.url, token="hf_ownerfailfast001").grant_access("owner/run", "carol")
        sets = [a for s in BASE for a in ("--set", s)]
        env = {"HF_HUB_DISABLE_XET": "1"}
        common = ("worker", tmp_path / "none.yaml", "--repo", "owner/run", "--endpoint", server.url)
        (tmp_path / "none.yaml").write_text("{}\n", encoding="utf-8")
        carol = run_cli(*common, "--node-id", "carol", *sets, env={**env, "HF_TOKEN": "hf_carolreadonly002"})
        assert carol.returncode == 1, carol.stderr
        assert "carol/run-deltas" in carol.stderr and "missing write permission" in carol.stderr
        dave = run_cli(*common, "--node-id", "dave", *sets, env={**env, "HF_TOKEN": "hf_davenoaccess0003"})
        assert dave.returncode == 1, dave.stderr
        assert "owner/run" in dave.stderr and "missing read permission" in dave.stderr
        for result in (carol, dave):
            assert "hf_carolreadonly002" not in result.stderr and "hf_davenoaccess0003" not in result.stderr
    finally:
        server.stop()


def test_a_worker_stops_at_the_runs_end_from_the_manifest(tmp_path: Path) -> None:
    """The manifest says the run ends at outer step 2; the global reaches it while this worker still
    has steps planned: its next sync point sends its final delta and the trainer ends there, as a
    normal end (not interrupted)."""
    cfg, bus, manifest, master = setup_run(
        tmp_path,
        "run.max_steps=40",
        "checkpoint.enabled=false",
        "distributed.worker.async_upload=false",
        "distributed.worker.async_global_poll=false",
    )
    manifest["run"]["outer_steps"] = 2
    bus.write_manifest(manifest)

    class Worker(Coordinator):
        def after_step(self, model, *, step, tokens):  # the master steps as soon as a delta lands
            installed = super().after_step(model, step=step, tokens=tokens)
            master.round()
            return installed

    coordinator = Worker(cfg, bus, "w1", manifest)
    result = Trainer(cfg, sync=coordinator).train()
    assert not result.interrupted and result.steps < 40
    assert coordinator.summary()["ended_early"]
    last = bus_deltas(bus, codec.param_specs(build_model(cfg, 64)))
    master.round()
    assert master.outer_step >= 2 and "w1" in master.finished  # its last delta said final
    assert last == [] or last[-1].meta["final"] == "1"
