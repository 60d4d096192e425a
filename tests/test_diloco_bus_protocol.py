"""The sealed Bus protocol: backends chosen by URL scheme (plugins included), conditional publish
(a second master is refused), leases (two racing claimers: exactly one wins), `publish(prune=)`
deleting exactly the globals named and nothing else (on every bus), the directory bus's global/
protected like deltas/, and `hub add-collaborator` refusing a private run repo the collaborator cannot
read.

Real files, real threads, the real huggingface_hub client against the loopback Hub server, boto3
against a loopback moto S3 server."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hub_server import HubServer
from speedtronic.diloco.bus.base import Bus, BusError, Claim, ClaimHeld, Head, HeadMoved, UnsafeLayout
from speedtronic.diloco.bus.directory import DirectoryBus
from speedtronic.diloco.bus.hub import HubBus
from speedtronic.diloco.bus.registry import open_bus, scheme_of
from speedtronic.errors import ConfigError
from speedtronic.hookspecs import Register, hookimpl
from speedtronic.plugins import get_plugin_host, reset_plugin_host
from test_diloco_hub_bus import ALICE, OWNER, make_bus

SRC = Path(__file__).resolve().parents[1] / "src"


# -- the registry -------------------------------------------------------------------------------------
class MirrorBus(DirectoryBus):
    """A plugin's backend: `mirror://NAME` is a directory under $MIRROR_ROOT (a real, whole Bus)."""

    scheme = "mirror"
    creates_on_master_start = True

    @classmethod
    def from_url(cls, url: str, **_: Any) -> MirrorBus:
        bus = cls(str(Path(os.environ["MIRROR_ROOT"]) / url.split("://", 1)[1]))
        bus.url = url
        return bus


class MirrorPlugin:
    @hookimpl
    def register_buses(self, register: Register) -> None:
        register("mirror", MirrorBus)
        register("lazymirror", "test_diloco_bus_protocol:MirrorBus")  # imported only when opened


@pytest.fixture
def mirror_plugin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("MIRROR_ROOT", str(tmp_path / "mirrors"))
    reset_plugin_host()
    get_plugin_host().register(MirrorPlugin(), name="mirror-plugin")
    yield
    reset_plugin_host()


@pytest.mark.usefixtures("isolated_env")
def test_open_bus_picks_the_backend_by_scheme(tmp_path: Path) -> None:
    assert type(open_bus(f"file://{tmp_path / 'run'}")) is DirectoryBus
    for url in ("owner/run", "hf://owner/run"):
        bus = open_bus(url, endpoint="http://127.0.0.1:9")  # no request is made to open one
        assert type(bus) is HubBus and bus.repo_id == "owner/run"
    assert [scheme_of(u) for u in ("s3://b/p", "FILE://x", "a/b", "hf://a/b")] == ["s3", "file", "hub", "hub"]


@pytest.mark.usefixtures("mirror_plugin")
def test_a_plugin_registers_a_backend_through_the_hook(tmp_path: Path) -> None:
    for url in ("mirror://run1", "lazymirror://run1"):
        bus = open_bus(url)
        assert type(bus) is MirrorBus and bus.url == url
    bus = open_bus("mirror://run1")
    bus.create_run()
    head = bus.publish(b"g0", {"outer_step": 0})
    assert open_bus("lazymirror://run1").read_global(head) == b"g0"  # one storage, through the protocol
    assert (tmp_path / "mirrors" / "run1" / "global" / "outer_00000000.safetensors").read_bytes() == b"g0"
    listed = {p["name"]: p for p in get_plugin_host().describe()}
    assert listed["mirror-plugin"]["registers"]["buses"] == ["lazymirror", "mirror"]


def test_a_plugin_may_not_take_a_built_in_scheme() -> None:
    from speedtronic.registry import PluginError

    class Hijack:
        @hookimpl
        def register_buses(self, register: Register) -> None:
            register("file", MirrorBus)

    reset_plugin_host()
    get_plugin_host().register(Hijack(), name="hijack")
    try:
        with pytest.raises(PluginError, match=r"plugin 'hijack' registered the bus scheme file://"):
            open_bus("file:///tmp/x")
    finally:
        reset_plugin_host()


def test_an_unknown_scheme_is_one_line_naming_repo(run_cli: Any) -> None:
    with pytest.raises(ConfigError) as error:
        open_bus("gs://bucket/run")
    message = str(error.value)
    assert "\n" not in message and "--repo" in message and "gs://" in message
    assert "file://" in message and "s3://" in message and "owner/name" in message
    result = run_cli("hub", "status", "gs://bucket/run")
    assert result.returncode == 2, result.stderr
    assert "--repo 'gs://bucket/run': no bus for gs://" in result.stderr


def test_role_code_uses_only_the_protocol() -> None:
    """No backend type checks, no Hub internals, no backend keys in documents outside the backends."""
    pattern = re.compile(r"isinstance\(bus|bus\.api|bus\.call|_revision|bus\.ensure")
    found = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
    roles = [
        "launch.py",
        "master/core.py",
        "master/state.py",
        "worker/coordinator.py",
        "worker/uploader.py",
        "worker/poller.py",
    ]
    for name in roles:
        text = (SRC / "speedtronic" / "diloco" / name).read_text(encoding="utf-8")
        assert "bus.directory" not in text and "bus.hub" not in text and "hub_client" not in text, name


# -- conditional publish ------------------------------------------------------------------------------
def test_a_stale_expected_head_is_refused_on_a_directory(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "run"))
    bus.create_run()
    first = bus.publish(b"g0", {"outer_step": 0})
    assert bus.read_head() == first and bus.read_head().version == first.version
    second = bus.publish(b"g1", {"outer_step": 1}, expected=first)  # master A
    with pytest.raises(HeadMoved, match="outer step 1"):
        bus.publish(b"g1-b", {"outer_step": 1}, expected=first)  # master B, from the same head
    with pytest.raises(HeadMoved):
        bus.publish(b"g2-b", {"outer_step": 2}, expected=first)
    assert bus.read_head() == second and bus.read_global(bus.read_head()) == b"g1"
    assert not (tmp_path / "run" / "global" / "outer_00000002.safetensors").exists()  # nothing written
    assert bus.publish(b"g2", {"outer_step": 2}, expected=second)["outer_step"] == 2


@pytest.mark.usefixtures("isolated_env")
def test_a_stale_expected_head_is_refused_on_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    server.state.add_user("owner", OWNER)
    try:
        a = make_bus(server, OWNER)
        a.create_run(private=False)
        first = a.publish(b"g0", {"outer_step": 0})
        assert first.version == server.state.repos["owner/run"].head[0]
        b = make_bus(server, OWNER)  # a second master with the same token
        stale = b.read_head()
        a.write_manifest({"format": 1})  # other commits move the sha but not the head: still fine
        second = a.publish(b"g1", {"outer_step": 1}, expected=first)
        # b's head document is the same as a's (no timestamps here): its global tells them apart.
        commits = len(server.state.repos["owner/run"].commits)
        with pytest.raises(HeadMoved, match="outer step 1"):
            b.publish(b"g1-b", {"outer_step": 1}, expected=stale)
        assert len(server.state.repos["owner/run"].commits) == commits  # nothing written
        assert a.read_head() == second and a.read_global(a.read_head()) == b"g1"
    finally:
        server.stop()


@pytest.mark.usefixtures("isolated_env")
def test_a_publish_whose_answer_was_lost_is_recognised_by_its_content(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    server.state.add_user("owner", OWNER)
    try:
        bus = make_bus(server, OWNER)
        bus.create_run(private=False)
        first = bus.publish(b"g0", {"outer_step": 0})
        server.hang_after_next(1, 3.0, match="/commit/")  # it lands; the answer never arrives in time
        new = bus.publish(b"g1", {"outer_step": 1}, expected=first)
        assert new == bus.read_head() and new.version == bus.read_head().version
        steps = [
            json.loads(files["head.json"])["outer_step"]
            for _, files in server.state.repos["owner/run"].commits
            if "head.json" in files
        ]
        assert steps == [0, 1]  # published once, not mistaken for another master's step
    finally:
        server.stop()


def test_a_second_master_stops_with_a_clear_error(tmp_path: Path) -> None:
    from speedtronic.errors import BusError, SpeedtronicError
    from test_diloco_master import Run

    run = Run(tmp_path, "distributed.rounds.min_deltas=1")
    first, second = run.master("state-a"), run.master("state-b")
    run.delta("w1", 0)
    assert first.round() is True and run.bus.read_head()["outer_step"] == 1
    run.delta("w1", 1)
    second.start()  # its first round applies w1's delta and tries to publish over the first's step
    second._thread.join(30)
    assert not second._thread.is_alive()  # it stopped instead of retrying
    error = second.error
    assert isinstance(error, SpeedtronicError) and not isinstance(error, BusError)
    message = str(error)
    assert re.search(r"file://\S+: another master advanced the run", message) and "\n" not in message
    assert "run one master per run" in message
    assert run.bus.read_head()["outer_step"] == 1 and run.bus.read_head()["hwm"] == {"w1": 0}


# -- leases -------------------------------------------------------------------------------------------
def race(claim: Any, holders: list[str]) -> tuple[list[Claim], list[ClaimHeld]]:
    start = threading.Barrier(len(holders))
    won: list[Claim] = []
    lost: list[ClaimHeld] = []

    def one(holder: str) -> None:
        start.wait()
        try:
            won.append(claim(holder))
        except ClaimHeld as error:
            lost.append(error)

    threads = [threading.Thread(target=one, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return won, lost


def test_directory_leases_exactly_one_racing_claimer_wins(tmp_path: Path) -> None:
    holders = [f"host{i}:pid{i}" for i in range(8)]
    buses = {h: DirectoryBus(str(tmp_path / "run")) for h in holders}  # one bus (and fd) per claimer
    won, lost = race(lambda h: buses[h].claim("w1", h, 60.0), holders)
    assert len(won) == 1 and len(lost) == 7
    winner = won[0].holder
    assert all(e.holder == winner and e.expires_in > 50 for e in lost)
    assert f"held by {winner!r}" in str(lost[0])
    assert json.loads((tmp_path / "run" / "leases" / "w1.json").read_text())["holder"] == winner
    bus = buses[winner]
    renewed = bus.claim("w1", winner, 60.0)  # the holder renews
    assert renewed.expires_at >= won[0].expires_at
    assert 50 < bus.lease_left("w1") <= 60 and bus.lease_left("w2") is None  # read only
    loser = next(h for h in holders if h != winner)
    buses[loser].release(Claim("w1", loser, 0.0))  # not the holder: nothing happens
    with pytest.raises(ClaimHeld):
        buses[loser].claim("w1", loser, 60.0)
    bus.release(renewed)
    assert bus.lease_left("w1") is None
    assert buses[loser].claim("w1", loser, 0.2).holder == loser  # free again
    time.sleep(0.3)
    assert bus.lease_left("w1") == 0.0  # expired, still there
    assert bus.claim("w1", winner, 60.0).holder == winner  # an expired lease is taken over
    with pytest.raises(BusError, match="invalid lease name"):
        bus.claim("../etc", winner, 1.0)


CLAIMER = """
import sys, time
from pathlib import Path
from speedtronic.diloco.bus.base import ClaimHeld
from speedtronic.diloco.bus.directory import DirectoryBus
run, holder, go = sys.argv[1:4]
bus = DirectoryBus(run)
Path(go + "." + holder).touch()  # ready
while not Path(go).exists():
    time.sleep(0.001)
try:
    print("won", bus.claim("master", holder, 60.0).holder)
except ClaimHeld as error:
    print("lost", error.holder)
"""


def test_directory_leases_exactly_one_racing_process_wins(tmp_path: Path) -> None:
    import subprocess
    import sys

    run, go = tmp_path / "run", tmp_path / "go"
    DirectoryBus(str(run)).create_run()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, str(run), f"proc{i}", str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(4)
    ]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"go.proc{i}").exists() for i in range(4)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # all of them imported and waiting: they claim at once
    answers = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    winners = [holder for verdict, holder in answers if verdict == "won"]
    assert len(winners) == 1 and all(holder == winners[0] for _, holder in answers)


@pytest.mark.usefixtures("isolated_env")
def test_hub_leases_exactly_one_racing_claimer_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    server.state.add_user("owner", OWNER)
    server.state.add_user("alice", ALICE)
    try:
        owner = make_bus(server, OWNER, retry_attempts=8)
        owner.create_run(private=False)
        owner.write_manifest({"format": 1, "collaborators": {"alice": {"user": "alice", "delta_repo": None}}})
        holders = [f"master-{i}" for i in range(6)]
        buses = {h: make_bus(server, OWNER, retry_attempts=8) for h in holders}
        won, lost = race(lambda h: buses[h].claim("master", h, 60.0), holders)
        assert len(won) == 1 and len(lost) == 5 and all(e.holder == won[0].holder for e in lost)
        lease = json.loads(server.files("owner/run")["leases/master.json"])
        assert lease["holder"] == won[0].holder
        buses[won[0].holder].release(won[0])
        assert "leases/master.json" not in server.files("owner/run")
        alice = make_bus(server, ALICE)
        alice.check_worker_access("alice")
        claim = alice.claim("alice", "alice@laptop", 60.0)  # in her own delta repo
        assert "leases/alice.json" in server.files("alice/run-deltas")
        assert 50 < owner.lease_left("alice") <= 60  # the master reads it (a silent node restarting)
        with pytest.raises(ClaimHeld, match="alice@laptop"):
            make_bus(server, ALICE).claim("alice", "alice@desktop", 60.0)
        alice.release(claim)
        assert "leases/alice.json" not in server.files("alice/run-deltas")
        assert owner.lease_left("alice") is None
    finally:
        server.stop()


# -- global/ is protected like deltas/ ----------------------------------------------------------------
def test_a_symlinked_global_dir_is_never_followed(tmp_path: Path) -> None:
    bus = DirectoryBus(str(tmp_path / "run"))
    bus.create_run()
    head = bus.publish(b"g0", {"outer_step": 0})
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "outer_00000000.safetensors").write_bytes(b"planted")
    (outside / "keep.txt").write_text("keep")
    global_dir = tmp_path / "run" / "global"
    for f in global_dir.iterdir():
        f.unlink()
    global_dir.rmdir()
    global_dir.symlink_to(outside, target_is_directory=True)
    with pytest.raises(UnsafeLayout, match=r"global/ is not a plain directory"):
        bus.read_global(head)  # the planted file is never read
    with pytest.raises(UnsafeLayout, match=r"global/ is not a plain directory"):
        bus.publish(b"g1", {"outer_step": 1}, expected=head, prune=[head["global"]])
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt", "outer_00000000.safetensors"]
    assert (outside / "outer_00000000.safetensors").read_bytes() == b"planted"
    assert bus.read_head() == head  # no head points anywhere new


@pytest.fixture(params=["file", "hub", "s3"])
def any_bus(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Bus, Callable[[], set[str]], Callable[[str, bytes], None]]]:
    """(a created run on each backend, the global/ paths stored there, plant(path, bytes) as an
    outsider with write access would)."""
    if request.param == "file":
        bus = DirectoryBus(str(tmp_path / "run"))
        bus.create_run()
        gdir = tmp_path / "run" / "global"
        yield (
            bus,
            lambda: {f"global/{p.name}" for p in gdir.iterdir() if not p.name.startswith(".")},
            lambda path, data: (tmp_path / "run" / path).write_bytes(data),
        )
    elif request.param == "hub":
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        server = HubServer()
        server.state.add_user("owner", OWNER)
        try:
            bus = make_bus(server, OWNER)
            bus.create_run(private=False)

            def plant(path: str, data: bytes) -> None:
                from huggingface_hub import HfApi

                HfApi(endpoint=server.url, token=OWNER).upload_file(
                    path_or_fileobj=data, path_in_repo=path, repo_id="owner/run"
                )

            yield bus, lambda: {f for f in server.files("owner/run") if f.startswith("global/")}, plant
        finally:
            server.stop()
    else:
        pytest.importorskip("boto3", reason="the S3 bus needs boto3 (pip install -e '.[dev]')")
        pytest.importorskip("flask", reason="moto's server needs moto[server] (flask)")
        from s3_server import ACCESS_KEY, SECRET_KEY, S3Server

        request.getfixturevalue("restore_secrets")
        for name, value in (
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ("AWS_DEFAULT_REGION", "us-east-1"),
            ("AWS_CONFIG_FILE", str(tmp_path / "aws-config")),
            ("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials")),
        ):
            monkeypatch.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(name, raising=False)
        server = S3Server()
        try:
            monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
            admin = server.admin()
            admin.create_bucket(Bucket="run-bucket")
            bus = open_bus("s3://run-bucket/run", retry_attempts=2, retry_initial=0.01, retry_max=0.05)
            bus.create_run()

            def stored() -> set[str]:
                listed = admin.list_objects_v2(Bucket="run-bucket", Prefix="run/global/")
                return {o["Key"][len("run/") :] for o in listed.get("Contents", [])}

            def plant(path: str, data: bytes) -> None:
                admin.put_object(Bucket="run-bucket", Key=f"run/{path}", Body=data)

            yield bus, stored, plant
        finally:
            server.stop()


def test_publish_prunes_exactly_the_globals_named_on_every_bus(
    any_bus: tuple[Bus, Callable[[], set[str]], Callable[[str, bytes], None]],
) -> None:
    """Issue 24: three junk `outer_9999999N` globals made the master prune the global it had just
    published. Now a bus deletes only what `prune` names, never the new head's global, never junk."""
    bus, stored, plant = any_bus
    bus.write_manifest({"format": 1})
    junk = {f"global/outer_9999999{n}.safetensors" for n in (7, 8, 9)} | {"global/notes.txt"}
    for path in junk:
        plant(path, b"junk")
    head = None
    published: list[str] = []
    for step in range(6):  # a master keeping its newest 3
        prune, keep = published[:-2], published[-2:]
        head = bus.publish(b"g%d" % step, {"outer_step": step}, expected=head, prune=prune)
        assert bus.read_global(bus.read_head()) == b"g%d" % step  # the one just written is there
        published = [p for p in keep if p != head["global"]] + [head["global"]]
    # Paths outside global/, a name no global has, and the new head's own global (as each bus names
    # it): named, and still never deleted.
    new = ["global/outer_00000006.safetensors", "global/model.safetensors"]
    hostile = ["manifest.json", "global/../manifest.json", "../outside", "global/notes.txt", *new]
    head = bus.publish(b"g6", {"outer_step": 6}, expected=head, prune=hostile)
    assert bus.read_global(bus.read_head()) == b"g6" and bus.read_manifest() is not None
    left = stored()
    assert junk <= left  # untouched
    assert head["global"] in left
    if bus.scheme == "hub":  # one path, overwritten every step: history holds the rest
        assert left == junk | {"global/model.safetensors"}
    else:
        assert left - junk == {f"global/outer_{s:08d}.safetensors" for s in (3, 4, 5, 6)}


def test_junk_and_special_files_in_global_never_block_or_mislead(tmp_path: Path) -> None:
    """Directory bus: a FIFO, a symlink and a directory named like globals are never followed, read or
    deleted; a directory under the next global's name is stepped around, not removed."""
    bus = DirectoryBus(str(tmp_path / "run"))
    bus.create_run()
    global_dir = tmp_path / "run" / "global"
    os.mkfifo(global_dir / "outer_99999996.safetensors")
    (global_dir / "outer_99999995.safetensors").symlink_to(tmp_path / "nowhere")
    (global_dir / "outer_00000002.safetensors").mkdir()
    (global_dir / "outer_00000002.safetensors" / "keep").write_text("keep")
    head, names = None, []
    for step in range(4):
        head = bus.publish(b"g%d" % step, {"outer_step": step}, expected=head)
        assert bus.read_global(bus.read_head()) == b"g%d" % step
        names.append(head["global"])
    assert re.fullmatch(r"global/outer_00000002\.[0-9a-f]{8}\.safetensors", names[2]), names
    assert (global_dir / "outer_00000002.safetensors" / "keep").read_text() == "keep"
    # The FIFO as the head's global (swapped in by someone): refused at once, never waited on.
    fifo_head = Head({"global": "global/outer_99999996.safetensors", "outer_step": 3})
    started = time.monotonic()
    with pytest.raises(BusError, match="not a regular file"):
        bus.read_global(fifo_head)
    with pytest.raises(BusError, match="cannot read"):
        bus.read_global(Head({"global": "global/outer_99999995.safetensors", "outer_step": 3}))
    assert time.monotonic() - started < 10
    bus.publish(
        b"g4",
        {"outer_step": 4},
        expected=head,
        prune=[
            "global/outer_99999996.safetensors",
            "global/outer_99999995.safetensors",
            "global/outer_00000002.safetensors",
            names[2],
        ],
    )
    assert (global_dir / "outer_99999996.safetensors").is_fifo()
    assert (global_dir / "outer_99999995.safetensors").is_symlink()
    assert (global_dir / "outer_00000002.safetensors" / "keep").read_text() == "keep"
    assert not (tmp_path / "run" / names[2]).exists()  # the one it wrote there: pruned
    with pytest.raises(BusError, match="not global/outer_<step>"):
        bus.read_global(Head({"global": "../manifest.json", "outer_step": 1}))


def test_a_worker_never_writes_through_a_symlinked_node_dir(tmp_path: Path) -> None:
    from speedtronic.diloco.bus.base import PermissionDenied

    bus = DirectoryBus(str(tmp_path / "run"))
    bus.create_run()
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run" / "deltas" / "w1").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PermissionDenied, match=r"deltas/w1 is a symlink"):
        bus.check_worker_access("w1")
    assert list(outside.iterdir()) == []


# -- add-collaborator ---------------------------------------------------------------------------------
@pytest.mark.usefixtures("isolated_env")
def test_add_collaborator_refuses_a_private_run_they_cannot_read(
    monkeypatch: pytest.MonkeyPatch, run_cli: Any
) -> None:
    """A private, ungated run repo is readable only by its owner's members: add-collaborator refuses at
    once (exit 2) naming the fixes, lists them anyway with --record-only (with the warning), lets an
    organisation's member in, and on a gated repo grants read access."""
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    server.state.add_user("owner", OWNER)
    server.state.add_user("alice", ALICE)
    server.state.add_user("bob", "hf_bobbusunit00000004")
    server.state.orgs["acme"] = {"owner": "admin", "bob": "read"}
    try:
        for repo, gated in (("owner/private-run", False), ("owner/gated-run", True), ("acme/org-run", False)):
            bus = make_bus(server, OWNER, repo=repo)
            bus.create_run(private=not gated, gated=gated)
            bus.write_manifest({"format": 1, "collaborators": {}})
        env = {"HF_TOKEN": OWNER, "HF_HUB_DISABLE_XET": "1"}

        def add(repo: str, user: str, *extra: str) -> Any:
            args = ("hub", "add-collaborator", repo, user, *extra, "--endpoint", server.url, "--json")
            return run_cli(*args, env=env)

        def listed(repo: str) -> dict[str, Any]:
            return json.loads(server.files(repo)["manifest.json"])["collaborators"]

        refused = add("owner/private-run", "alice")
        assert refused.returncode == 2, refused.stderr
        assert "owner/private-run is private and not gated, so alice cannot read the run" in refused.stderr
        assert "gated" in refused.stderr and "add alice to the owner organisation" in refused.stderr
        assert "--record-only" in refused.stderr and "Traceback" not in refused.stderr
        assert "alice" not in listed("owner/private-run")  # refused before anything was written

        recorded = add("owner/private-run", "alice", "--record-only")
        assert recorded.returncode == 0, recorded.stderr
        out = json.loads(recorded.stdout.strip().splitlines()[-1])
        assert out["granted_read_access"] is False and out["readable"] is False
        assert out["delta_repo"] == "alice/private-run-deltas"
        assert "warning: owner/private-run is private and not gated" in recorded.stderr
        assert listed("owner/private-run")["alice"]["delta_repo"] == "alice/private-run-deltas"

        member = add("acme/org-run", "bob")  # a member of the organisation reads its private repos
        assert member.returncode == 0, member.stderr
        assert json.loads(member.stdout.strip().splitlines()[-1])["readable"] is True
        assert "bob" in listed("acme/org-run")
        assert add("acme/org-run", "alice").returncode == 2  # not a member

        gated = add("owner/gated-run", "bob")
        assert gated.returncode == 0 and "warning" not in gated.stderr, gated.stderr
        assert json.loads(gated.stdout.strip().splitlines()[-1])["granted_read_access"] is True
        assert "bob" in server.state.repos["owner/gated-run"].granted
        for result in (refused, recorded, member, gated):
            assert OWNER not in result.stdout + result.stderr
    finally:
        server.stop()
