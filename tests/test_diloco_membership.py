"""Who may send deltas is the manifest's list, on every bus as on the Hub: a node id the run does not
list is refused at start (it would train and upload deltas the master ignores, then exit 0), and a
worker whose collaborator entry the owner removes while it runs stops with the same refusal instead
of waiting max_wait at every sync for a master that no longer looks at its deltas."""

from __future__ import annotations

import json

import pytest

from swarm_harness import Swarm, text_path, write_config


@pytest.mark.slow
def test_an_unlisted_node_is_refused_and_a_removed_one_stops(tmp_path) -> None:
    cfg = write_config(tmp_path, text_path(), max_steps=100000, membership_refresh_s=1.0)
    swarm = Swarm(tmp_path)
    try:
        swarm.init(cfg, ["w1"])
        stranger = swarm.worker(cfg, "w9")
        assert swarm.wait_exit(stranger, 300) == 1, swarm.log(stranger)[-3000:]
        errors = [line for line in swarm.log(stranger).splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "node 'w9' is not a collaborator of this run" in errors[0], errors
        assert f"hub add-collaborator {swarm.repo} w9" in errors[0], errors
        assert not (tmp_path / "runs" / "dl" / "w9" / "checkpoints").exists()  # it never trained

        worker = swarm.worker(cfg, "w1")
        swarm.wait_log(worker, r"step \d+/\d+ ·", timeout=300)  # training, a listed node
        path = swarm.bus_dir / "manifest.json"
        manifest = json.loads(path.read_text())
        manifest["collaborators"] = {"w2": manifest["collaborators"]["w1"]}  # the owner removes w1
        path.write_text(json.dumps(manifest))
        # No master runs: the worker must find out from the manifest itself, not from a master.
        assert swarm.wait_exit(worker, 300) == 1, swarm.log(worker)[-3000:]
        errors = [line for line in swarm.log(worker).splitlines() if line.startswith("error:")]
        assert len(errors) == 1, swarm.log(worker)[-3000:]
        assert "node 'w1' was removed from this run's collaborators" in errors[0], errors
        assert "Traceback" not in swarm.log(worker)
    finally:
        swarm.close()


@pytest.mark.parametrize(
    ("node", "role", "stops"), [("w2", "worker", True), ("w1", "worker", False), ("master", "master", False)]
)
def test_a_re_read_manifest_stops_only_a_worker_it_does_not_list(
    tmp_path, node: str, role: str, stops: bool
) -> None:
    """The master's own training node is never listed (it answers to the master): it never stops so."""
    from speedtronic.diloco.manifest import add_collaborator
    from speedtronic.diloco.worker import Coordinator
    from test_diloco_coordinator import setup_run

    cfg, bus, manifest, _ = setup_run(
        tmp_path, f"distributed.node.role={role}", "distributed.master.membership_refresh_s=0"
    )
    bus.write_manifest(add_collaborator(manifest, "w1", "alice"))
    coordinator = Coordinator(cfg, bus, node, manifest)  # joined while the run was open to all
    coordinator.poller._membership_at = float("-inf")  # due for a re-read
    coordinator.poller.check_membership()
    error = coordinator.fault.error
    assert (error is not None) == stops, error
    if stops:
        assert f"node {node!r} was removed from this run's collaborators" in str(error)
