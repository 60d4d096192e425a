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
