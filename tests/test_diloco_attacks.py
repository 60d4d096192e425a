"""Attacks on the directory bus, through real files: whoever can write into deltas/ is hostile.

Each test plants the attack as real filesystem objects (symlinks, FIFOs, directories, garbage and
replayed bytes), runs the master's real rounds on a real DirectoryBus, and asserts three things:
nothing outside the bus changed, no node's state moved because of the rejected input, and the run
went on (valid deltas that came after were applied). The multi-process version with the real CLI
is in test_diloco_swarm.py.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.bus.base import BusError, DeltaRef
from speedtronic.diloco.master import Master
from test_diloco_master import Run


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root` (not following links) with a digest of what it is."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path.relative_to(root))] = "link:" + os.readlink(path)
        elif path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            out[str(path.relative_to(root))] = "dir"
    return out


def weights(m: Master) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in m.outer.weights.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[n], b[n]) for n in a)


def round_in_thread(m: Master) -> bool:
    """One round on a thread, so a FIFO that blocked it would fail the test instead of hanging it."""
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(m.round()), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the master's round blocked"
    return result[0]


def outside_with_deltas(run: Run, tmp_path: Path) -> Path:
    """A directory outside the bus holding files a master must never read or delete: valid deltas."""
    outside = tmp_path / "outside"
    outside.mkdir()
    run.delta("victim", 0)
    run.delta("w2", 0)
    for node in ("victim", "w2"):
        source = run.bus.root / "deltas" / node / codec.delta_name(node, 0)
        (outside / source.name).write_bytes(source.read_bytes())
        source.unlink()
        source.parent.rmdir()
    (outside / "evil.safetensors").write_bytes(b"not a delta")
    return outside


def test_symlinked_node_dirs_and_files_are_never_followed_read_or_deleted_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    outside = outside_with_deltas(run, tmp_path)
    before = tree_digest(outside)
    deltas = run.bus.root / "deltas"
    (deltas / "victim").symlink_to(outside, target_is_directory=True)  # a whole node dir
    (deltas / "w2").mkdir()
    (deltas / "w2" / "w2--00000000.safetensors").symlink_to(outside / "w2--00000000.safetensors")
    good = run.delta("w1", 0)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert m.round() is True
        m.round()
    assert m.applied == [good] and m.rejected == []
    assert m.hwm == {"w1": 0}  # nothing moved for the linked nodes
    assert tree_digest(outside) == before  # nothing outside the bus read-deleted or changed
    assert (deltas / "victim").is_symlink() and (deltas / "w2" / "w2--00000000.safetensors").is_symlink()
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 2 and any("victim (a symlink)" in line for line in skipped), skipped
    # The run goes on.
    nxt = run.delta("w1", 1)
    assert m.round() is True and m.applied == [good, nxt]


def test_a_node_dir_swapped_for_a_symlink_after_listing_is_not_read_or_deleted_through(
    tmp_path: Path,
) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    run.delta("w1", 0)
    (ref,) = run.bus.list_deltas(None)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ref.name).write_bytes(b"precious")
    node_dir = run.bus.root / "deltas" / "w1"
    (node_dir / ref.name).unlink()
    node_dir.rmdir()
    node_dir.symlink_to(outside, target_is_directory=True)  # the race: between list and read/delete
    with pytest.raises(BusError, match="cannot read w1/"):
        run.bus.get_delta(ref, 1 << 20)
    run.bus.delete_deltas([ref])
    assert (outside / ref.name).read_bytes() == b"precious"


def test_directories_and_fifos_named_like_deltas_are_skipped_without_blocking(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    deltas = run.bus.root / "deltas"
    (deltas / "w2" / "w2--00000000.safetensors").mkdir(parents=True)
    (deltas / "w3").mkdir()
    fifo = deltas / "w3" / "w3--00000000.safetensors"
    os.mkfifo(fifo)
    good = run.delta("w1", 0)
    assert round_in_thread(m) is True
    assert m.applied == [good] and m.rejected == [] and m.pending_count == 0
    assert fifo.exists() and (deltas / "w2" / "w2--00000000.safetensors").is_dir()
    # Even handed a reference to the FIFO directly, the bus refuses it instead of blocking on it.
    forged = DeltaRef("w3", fifo.name, 0, str(fifo.parent))
    with pytest.raises(BusError, match="not a regular file"):
        run.bus.get_delta(forged, 1 << 20)
    assert run.bus.list_deltas(None) == []  # `hub status` shows nothing pending


def test_reads_stop_at_the_size_limit(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.defences.max_delta_mb=0.01")
    run.raw("w1", "w1--00000000.safetensors", b"\0" * 5_000_000)
    (ref,) = run.bus.list_deltas(None)
    assert len(run.bus.get_delta(ref, 10_000)) == 10_001


def test_garbage_with_a_huge_sequence_number_moves_no_state(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    run.raw("w1", "w1--99999999.safetensors", b"garbage" * 100)
    first = run.delta("w1", 0)
    assert m.round() is True and m.applied == [first]
    assert m.round() is False  # the garbage is now w1's oldest file: rejected...
    assert "w1/w1--99999999.safetensors" in {r["id"] for r in m.rejected}
    assert m.hwm == {"w1": 0} and run.bus.read_head()["hwm"] == {"w1": 0}  # ...moving nothing
    later = run.delta("w1", 1)  # so the worker's next delta is applied, not deleted as "processed"
    assert m.round() is True and m.applied == [first, later]


def test_a_worker_numbers_its_deltas_past_garbage_it_did_not_write(tmp_path: Path) -> None:
    from speedtronic import Trainer
    from speedtronic.diloco.worker import Coordinator
    from test_diloco_coordinator import setup_run

    cfg, bus, manifest, master = setup_run(
        tmp_path, "checkpoint.enabled=false", "distributed.worker.async_upload=false"
    )
    (bus.root / "deltas" / "w1").mkdir()
    (bus.root / "deltas" / "w1" / "w1--99999999.safetensors").write_bytes(b"garbage")
    coordinator = Coordinator(cfg, bus, "w1", manifest)
    Trainer(cfg, sync=coordinator, progress=False).train(max_steps=4)
    assert coordinator.uploaded == ["w1--00000000.safetensors", "w1--00000001.safetensors"]
    assert master.round() is True and master.round() is True
    assert master.applied == ["w1/w1--00000000.safetensors", "w1/w1--00000001.safetensors"]


def test_a_poisoned_first_delta_is_bounded_without_history(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    start = weights(m)
    run.delta("w1", 0, scale=1.0)  # 1000× an honest delta (1e-3), and nothing to compare it with
    assert m.round() is False
    (rejection,) = m.rejected
    assert "global weights' norm" in rejection["reason"]
    assert same(weights(m), start) and m.hwm == {} and m.outer_step == 0
    # Its norm never becomes a reference: only deltas that weighed in a kept step enter the history.
    assert m.norm_history == []
    honest = run.delta("w1", 1)
    assert m.round() is True and m.applied == [honest] and m.hwm == {"w1": 1}


def test_replayed_bytes_are_recognised_by_checksum_whatever_the_name(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    m = run.master()
    first = run.delta("w1", 0)
    data = (run.bus.root / "deltas" / first).read_bytes()
    assert m.round() is True
    after = weights(m)
    run.raw("w1", "w1--00000001.safetensors", data)  # the same bytes, the next sequence number
    assert m.round() is False
    assert m.rejected[-1]["reason"] == f"replay: the same payload as {first}"
    assert same(weights(m), after) and m.hwm == {"w1": 0}
    # A restarted master remembers what it applied.
    again = run.master()
    run.raw("w1", "w1--00000005.safetensors", data)
    assert again.round() is False and again.rejected[-1]["reason"].startswith("replay")
    nxt = run.delta("w1", 2)
    assert again.round() is True and again.applied == [first, nxt] and again.hwm == {"w1": 2}


def test_one_nodes_backlog_never_fills_a_round_meant_for_several(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Run(tmp_path, "distributed.master.collaborators=[w1,w2]", "distributed.rounds.max_wait=600")
    m = run.master()
    for seq in range(3):
        run.delta("w1", seq)
    with caplog.at_level(logging.INFO, logger="speedtronic.diloco"):
        assert m.round() is False and m.round() is False
    waits = [r.getMessage() for r in caplog.records if "waits for deltas from 2 nodes" in r.getMessage()]
    assert len(waits) == 1 and "have w1; waiting on w2" in waits[0] and "proceeds" in waits[0]
    run.delta("w2", 0)
    assert m.round() is True
    assert sorted(m.applied) == ["w1/w1--00000000.safetensors", "w2/w2--00000000.safetensors"]


def test_a_node_that_sent_its_final_delta_is_not_waited_for(tmp_path: Path) -> None:
    run = Run(tmp_path, "distributed.master.collaborators=[w1,w2]", "distributed.rounds.max_wait=600")
    m = run.master()
    run.delta("w1", 0, final="1")
    run.delta("w2", 0)
    assert m.round() is True and m.finished == {"w1"}
    run.delta("w2", 1, final="1")  # w1 is done: w2's last delta makes a round on its own
    assert m.round() is True and m.finished == {"w1", "w2"} and m.outer_step == 2
    run.delta("w1", 1)  # w1 rejoins: it is waited for again
    assert m.round() is True and m.finished == {"w2"}


@pytest.mark.usefixtures("isolated_env")
def test_on_the_hub_bus_replays_and_garbage_move_no_state_and_are_not_read_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's own delta repo holds garbage under a huge number and a replay of her applied delta; the
    master cannot delete them there, so it remembers them by blob id and never downloads them again."""
    from hub_server import HubServer
    from speedtronic.diloco.manifest import add_collaborator
    from test_diloco_hub_bus import ALICE, OWNER, make_bus

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    server.state.add_user("owner", OWNER)
    server.state.add_user("alice", ALICE)
    try:
        run = Run(tmp_path, "distributed.rounds.min_deltas=1")
        owner = make_bus(server, OWNER)
        owner.api.create_repo("owner/run", private=False)
        manifest = add_collaborator(run.manifest, "alice", "alice", None)
        owner.write_manifest(manifest)
        alice = make_bus(server, ALICE)
        alice.check_worker_access("alice")
        m = Master(
            run.cfg,
            owner,
            manifest,
            codec.snapshot(run.model),
            state_dir=tmp_path / "hub-state",
            momentum=0.0,
        )
        m.start_state()
        run.delta("alice", 0)  # real delta bytes, made on the directory bus, sent through the Hub
        data = (run.bus.root / "deltas" / "alice" / "alice--00000000.safetensors").read_bytes()
        alice.put_delta("alice", "alice--00000000.safetensors", data)
        assert m.round() is True and m.hwm == {"alice": 0}
        after = weights(m)
        alice.put_delta("alice", "alice--00000001.safetensors", data)  # a replay
        alice.put_delta("alice", "alice--99999999.safetensors", b"garbage" * 10)
        assert m.round() is False and m.round() is False
        reasons = {r["id"]: r["reason"] for r in m.rejected}
        assert reasons["alice/alice--00000001.safetensors"].startswith("replay")
        # Refused by its number alone, before any download (no honest worker numbers that far past
        # the master's mark; it used to be downloaded and refused as corrupt).
        assert (
            "sequence number 99999999" in reasons["alice/alice--99999999.safetensors"] and len(reasons) == 2
        )
        assert same(weights(m), after) and m.hwm == {"alice": 0} and owner.read_head()["hwm"] == {"alice": 0}
        downloads = sum("resolve" in path for _, path in server.state.requests)
        assert m.round() is False  # nothing re-read: both are remembered by their blob ids
        assert sum("resolve" in path for _, path in server.state.requests) == downloads
        run.delta("alice", 2)
        fresh = (run.bus.root / "deltas" / "alice" / "alice--00000002.safetensors").read_bytes()
        alice.put_delta("alice", "alice--00000002.safetensors", fresh)
        assert m.round() is True and m.hwm == {"alice": 2}
    finally:
        server.stop()


def test_a_copy_of_a_pending_delta_under_a_name_that_sorts_first_never_gets_the_original_rejected(
    tmp_path: Path,
) -> None:
    """A collaborator copies w1's pending delta as its own ("a" sorts before "w1"). Before the fix the
    first in name order won and w1's honest delta was rejected as the replay. Now: a copy seen after
    the original is the one rejected; both seen in one poll are both accepted and counted once."""
    run = Run(
        tmp_path,
        "distributed.rounds.min_deltas=3",
        "distributed.defences.aggregation=mean",
        "distributed.master.collaborators=[a,w1,w2,w3]",  # w3 is expected: the round waits for it
    )
    m = run.master()

    def tensors(delta_id: str) -> dict[str, torch.Tensor]:
        data = (run.bus.root / "deltas" / delta_id).read_bytes()
        return codec.decode(data, run.specs, kind="delta").tensors

    def copy_as(node: str, delta_id: str, seq: int) -> str:
        decoded = codec.decode((run.bus.root / "deltas" / delta_id).read_bytes(), run.specs, kind="delta")
        meta = {k: v for k, v in decoded.meta.items() if k not in ("format", "codec", "checksum")}
        name = codec.delta_name(node, seq)
        run.bus.put_delta(node, name, codec.encode(decoded.tensors, "fp32", {**meta, "node": node}))
        return f"{node}/{name}"

    original, other = run.delta("w1", 0), run.delta("w2", 0)
    assert m.round() is False  # two seen, the round waits for a third
    copy = copy_as("a", original, 0)
    assert m.round() is True
    assert sorted(m.applied) == sorted([original, other]) and [r["id"] for r in m.rejected] == [copy]
    assert m.rejected[0]["reason"] == f"replay: a copy of {original}, which was on the bus first"
    # Seen in one poll: which one is the copy is unknown; both count as applied, the payload once —
    # and the copy, weighing 0, does not fill min_deltas: the round waits for a third delta that weighs.
    before = weights(m)
    original, other = run.delta("w1", 1, base=1), run.delta("w2", 1, base=1)  # built on outer step 1
    copy = copy_as("a", original, 1)
    d1, d2 = tensors(original), tensors(other)
    assert m.round() is False
    third = run.delta("w3", 0, base=1)
    d3 = tensors(third)
    assert m.round() is True
    assert sorted(m.applied[2:]) == sorted([original, other, copy, third]) and len(m.rejected) == 1
    for name, w in weights(m).items():  # lr 1, no momentum: θ − (Δ1 + Δ2 + Δ3)/3, not with Δ1 twice
        torch.testing.assert_close(w, before[name] - (d1[name] + d2[name] + d3[name]) / 3)
