"""global/ protected like deltas/, through the real CLI (issue 24 item 6): a master and a worker as real
`speedtronic` processes on a directory bus that someone with write access to the bus root tampers with.

- global/ swapped for a symlink to another directory (at start, and in the middle of a run): the master
  refuses with one error naming global/ and exits non-zero; the other directory is untouched.
- junk named like globals (`outer_9999999N.safetensors`, a FIFO, a directory under the name of a global
  the master is about to write): the run completes, head.json always names an existing regular file,
  the junk is untouched, and the master prunes only the globals it wrote.
The bus-level checks (every backend, S3 included) are in test_diloco_bus_protocol.py."""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import pytest
import torch

from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.master.state import KEEP_GLOBALS
from test_diloco_multiprocess import TEXT, Procs, wait_until, write_config

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path)
    yield p
    p.kill_all()


def outer_step(bus_dir: Path) -> int:
    try:
        return int(json.loads((bus_dir / "head.json").read_text())["outer_step"])
    except (OSError, ValueError, KeyError):
        return -1


def plant_outside(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """The directory a planted global/ link points at, with files a master must never touch."""
    outside = tmp_path / "outside"
    outside.mkdir()
    files = {"outer_00000000.safetensors": b"planted", "outer_00000001.safetensors": b"x", "keep.txt": b"k"}
    for name, data in files.items():
        (outside / name).write_bytes(data)
    return outside, files


def put_delta(bus_dir: Path, seq: int) -> None:
    """A well-formed small delta of node w1 on the current global (what its worker would send)."""
    bus = DirectoryBus(str(bus_dir))
    manifest = bus.read_manifest()
    assert manifest is not None
    g = torch.Generator().manual_seed(seq)
    specs = codec.specs_from_json(manifest["params"])
    tensors = {n: torch.randn(s.shape, generator=g) * 1e-3 for n, s in specs.items()}
    meta = {"kind": "delta", "node": "w1", "seq": str(seq), "local_step": str(5 * (seq + 1))}
    meta.update(base_outer_step=str(outer_step(bus_dir)), tokens="64", final="0")
    bus.put_delta("w1", codec.delta_name("w1", seq), codec.encode(tensors, "fp32", meta))


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_a_symlinked_global_dir_stops_the_master_and_nothing_outside_is_touched(
    tmp_path: Path, procs: Procs
) -> None:
    # loss_probe off: the test's deltas are random (a worker's would descend), and each must make an
    # outer step so that a publish meets the planted link; the probe would weigh them 0 (no step).
    cfg = write_config(
        tmp_path, TEXT if TEXT.exists() else None, max_steps=40, min_deltas=1, loss_probe=False
    )
    bus_dir = tmp_path / "bus"
    outside, outside_files = plant_outside(tmp_path)
    # At start: the run exists (hub init), then global/ is replaced by a link.
    init = procs.start("init", "hub", "init", f"file://{bus_dir}", "--config", cfg)
    assert init.wait(240) == 0, procs.log("init")[-3000:]
    (bus_dir / "global").rename(tmp_path / "global.real")
    (bus_dir / "global").symlink_to(outside, target_is_directory=True)
    master = procs.start("master", "master", cfg, "--repo", f"file://{bus_dir}", "--no-train")
    assert master.wait(240) != 0
    log = procs.log("master")
    assert re.search(r"error: .*global/ is not a plain directory .*remove \S+/bus/global", log), log[-3000:]
    assert contents(outside) == outside_files
    assert json.loads((bus_dir / "head.json").read_text())["global"] == "global/outer_00000000.safetensors"

    # In the middle of a run: a round is published, global/ is swapped for the link, and the next
    # round's publish meets it. The deltas are written here, as a collaborator's worker would.
    (bus_dir / "global").unlink()
    (tmp_path / "global.real").rename(bus_dir / "global")
    master = procs.start("master2", "master", cfg, "--repo", f"file://{bus_dir}", "--no-train")
    put_delta(bus_dir, 0)
    wait_until(lambda: outer_step(bus_dir) >= 1, timeout=240, what="the first round")
    (bus_dir / "global").rename(tmp_path / "global.real")
    (bus_dir / "global").symlink_to(outside, target_is_directory=True)
    put_delta(bus_dir, 1)
    assert master.wait(240) != 0
    log = procs.log("master2")
    assert re.search(r"error: DiLoCo master: .*global/ is not a plain directory", log), log[-3000:]
    assert contents(outside) == outside_files  # nothing written there, nothing deleted
    named = json.loads((bus_dir / "head.json").read_text())["global"]
    assert named == "global/outer_00000001.safetensors"
    assert (tmp_path / "global.real" / Path(named).name).is_file()  # the head names a real global
    # A worker reading that run stops too, with the same error, instead of reading the planted files.
    worker = procs.start("w2", "worker", cfg, "--repo", f"file://{bus_dir}", "--node-id", "w2")
    assert worker.wait(240) != 0
    assert "global/ is not a plain directory" in procs.log("w2"), procs.log("w2")[-3000:]
    assert contents(outside) == outside_files


def test_junk_in_global_neither_breaks_the_run_nor_is_touched(tmp_path: Path, procs: Procs) -> None:
    """Issue 24: three junk `global/outer_9999999N` files made the master prune the global it had just
    published, so head.json named a missing file."""
    cfg = write_config(tmp_path, TEXT if TEXT.exists() else None, max_steps=30)
    bus_dir = tmp_path / "bus"
    DirectoryBus(str(bus_dir)).create_run()  # the layout only: the master writes the manifest
    gdir = bus_dir / "global"
    junk = {f"outer_9999999{n}.safetensors": b"junk %d" % n for n in (7, 8, 9)}
    for name, data in junk.items():
        (gdir / name).write_bytes(data)
    os.mkfifo(gdir / "outer_99999996.safetensors")  # a FIFO named like a global nobody writes
    os.mkfifo(gdir / "outer_00000002.safetensors")  # and one under a name the master will write
    (gdir / "outer_00000003.safetensors").mkdir()  # a directory where a global goes: stepped around
    (gdir / "outer_00000003.safetensors" / "keep").write_bytes(b"keep")
    (gdir / "outer_99999995.safetensors").symlink_to(tmp_path / "nowhere")

    master = procs.start("master", "master", cfg, "--repo", f"file://{bus_dir}", "--no-train", "--json")
    worker = procs.start("w1", "worker", cfg, "--repo", f"file://{bus_dir}", "--node-id", "w1", "--json")
    seen: set[str] = set()
    deadline = time.monotonic() + 480
    while (worker.poll() is None or master.poll() is None) and time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            head = json.loads((bus_dir / "head.json").read_text())
        except (OSError, ValueError):
            continue  # not published yet
        info = os.stat(bus_dir / head["global"], follow_symlinks=False)  # raises if it were missing
        assert stat.S_ISREG(info.st_mode), head["global"]
        seen.add(head["global"])
    rm, rw = procs.result("master", master), procs.result("w1", worker)
    assert rm["rejected"] == [] and set(rm["applied"]) == {f"w1/{n}" for n in rw["uploaded"]}
    last = rm["outer_step"]
    assert last >= 6 and len(seen) >= 3, (last, seen)

    assert {n: (gdir / n).read_bytes() for n in junk} == junk
    assert stat.S_ISFIFO(os.stat(gdir / "outer_99999996.safetensors").st_mode)
    assert (gdir / "outer_99999995.safetensors").is_symlink()
    assert (gdir / "outer_00000003.safetensors" / "keep").read_bytes() == b"keep"
    # What the master wrote: only its newest KEEP_GLOBALS are left (step 3 went under a random name,
    # pruned since).
    own = sorted(p.name for p in gdir.iterdir() if p.name.startswith("outer_0") and p.is_file())
    kept = range(last - KEEP_GLOBALS + 1, last + 1)
    assert [n for n in own if n.split(".")[1] == "safetensors"] == [
        f"outer_{s:08d}.safetensors" for s in kept if s != 3
    ], own
    assert len(own) == len(kept), own  # step 3's randomly named global too while it is one of them
    assert re.search(
        r"ignoring global/outer_00000003\.safetensors \(not a file; outer step 3 goes to "
        r"outer_00000003\.[0-9a-f]{8}\.safetensors\)",
        procs.log("master"),
    ), procs.log("master")[-3000:]
    assert not any("9999999" in g for g in seen)  # junk never became the run's global
