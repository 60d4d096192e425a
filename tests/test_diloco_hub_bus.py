"""The Hub bus against the loopback Hub server, driven by the real huggingface_hub client: reads by
commit sha, per-collaborator delta repos, retries on transient errors only (429 Retry-After honoured),
timeouts on hung requests, no stale reads while the server is down, history squashing."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from huggingface_hub import CommitOperationAdd

import hub_server
from hub_server import HubServer
from speedtronic.config import load_config
from speedtronic.diloco.bus.base import BusError, GlobalTooLarge, PermissionDenied, TransientBusError
from speedtronic.diloco.bus.hub import HubBus

pytestmark = pytest.mark.usefixtures("isolated_env")

OWNER, ALICE = "hf_ownerbusunit0001", "hf_alicebusunit0002"


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    s = HubServer()
    s.state.add_user("owner", OWNER)
    s.state.add_user("alice", ALICE)
    yield s
    s.stop()


def lfs_on(server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server answers "lfs" for safetensors, as the Hub does; this process's client takes the LFS
    path, not Xet (which the loopback Hub does not speak; the constant is read once at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    server.state.lfs_suffixes = (".safetensors",)


def make_bus(server: HubServer, token: str, repo: str = "owner/run", **dist: object) -> HubBus:
    settings = {"retry_initial": 0.05, "retry_max": 0.2, "retry_attempts": 3, "request_timeout": 1.0, **dist}
    cfg = load_config(None, [f"distributed.bus.{k}={v}" for k, v in settings.items()])
    return HubBus(repo, config=cfg.distributed.bus, endpoint=server.url, token=token)


def make_run(server: HubServer) -> HubBus:
    bus = make_bus(server, OWNER)
    bus.api.create_repo("owner/run", private=False)
    bus.write_manifest(
        {
            "format": 1,
            "collaborators": {
                "master": {"user": "owner", "delta_repo": "owner/run"},
                "alice": {"user": "alice", "delta_repo": None},
            },
        }
    )
    bus.api.update_repo_settings("owner/run", gated="manual")
    bus.api.grant_access("owner/run", "alice")
    return bus


def test_global_and_head_are_read_at_one_commit(server: HubServer) -> None:
    bus = make_run(server)
    bus.publish(b"global-0", {"outer_step": 0})
    head = bus.read_head()
    assert head.version == server.state.repos["owner/run"].head[0]  # the commit it was read at
    bus.publish(b"global-1", {"outer_step": 1})
    assert bus.read_global(head) == b"global-0"  # pinned by sha
    assert bus.read_head()["outer_step"] == 1
    server.stop()
    with pytest.raises(TransientBusError):
        bus.read_head()  # never the cached copy while the server is down
    server.start()
    assert bus.read_head()["outer_step"] == 1


def test_collaborator_delta_repo_is_theirs_gated_and_readable_by_the_owner(server: HubServer) -> None:
    owner = make_run(server)
    alice = make_bus(server, ALICE)
    alice.check_worker_access("alice")
    repo = server.state.repos["alice/run-deltas"]
    assert repo.gated and "owner" in repo.granted
    alice.put_delta("alice", "alice--00000000.safetensors", b"d0")
    alice.put_delta("alice", "alice--00000001.safetensors", b"d1", prune=["alice--00000000.safetensors"])
    refs = owner.list_deltas(None)
    assert [(r.node, r.name) for r in refs] == [("alice", "alice--00000001.safetensors")]
    assert owner.get_delta(refs[0], 100) == b"d1"
    with pytest.raises(PermissionDenied, match="alice/run-deltas"):
        owner.put_delta("alice", "alice--00000002.safetensors", b"x")  # nobody else writes there


def test_org_run_members_write_deltas_into_the_run_repo_and_the_master_clears_them(
    server: HubServer,
) -> None:
    """Org mode: the run repo belongs to an organisation and members with a write role list it as
    their delta repo (`hub add-collaborator --delta-repo ORG/RUN`). No per-user repo is created; the
    node is named by its folder (members of one org trust each other), and since no worker may prune
    there, the master deletes what it has processed. A member with a read role cannot take part."""
    server.state.add_user("carol", "hf_carolbusunit0003")
    server.state.orgs["acme"] = {"owner": "admin", "alice": "write", "carol": "read"}
    owner = make_bus(server, OWNER, repo="acme/run")
    owner.api.create_repo("acme/run", private=True)
    shared = {"delta_repo": "acme/run"}
    owner.write_manifest(
        {
            "format": 1,
            "collaborators": {
                "master": {"user": "owner", **shared},
                "alice": {"user": "alice", **shared},
                "carol": {"user": "carol", **shared},
            },
        }
    )
    alice = make_bus(server, ALICE, repo="acme/run")
    alice.check_worker_access("alice")
    assert not any(r.endswith("-deltas") for r in server.state.repos)  # nothing else was created
    alice.put_delta("alice", "alice--00000000.safetensors", b"d0")
    alice.put_delta("alice", "alice--00000001.safetensors", b"d1", prune=["alice--00000000.safetensors"])
    refs = owner.list_deltas(None)
    # prune is ignored in the shared repo: both files wait for the master, attributed to alice.
    assert [(r.node, r.name) for r in refs] == [
        ("alice", "alice--00000000.safetensors"),
        ("alice", "alice--00000001.safetensors"),
    ]
    assert [owner.get_delta(r, 100) for r in refs] == [b"d0", b"d1"]
    owner.delete_deltas(refs)
    assert owner.list_deltas(None) == [] and alice.list_own_deltas("alice") == []
    carol = make_bus(server, "hf_carolbusunit0003", repo="acme/run")
    with pytest.raises(PermissionDenied, match=r"acme/run: missing write permission"):
        carol.check_worker_access("carol")


def test_transient_errors_are_retried_and_429_waits_for_retry_after(
    server: HubServer, caplog: pytest.LogCaptureFixture
) -> None:
    bus = make_run(server)
    bus.publish(b"g", {"outer_step": 3})
    server.fail_next(2, 503)
    assert bus.read_head()["outer_step"] == 3
    server.fail_next(1, 429)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        assert bus.read_head()["outer_step"] == 3
    assert any(
        "HTTP 429" in r.getMessage() and "retrying in 1.0s" in r.getMessage() for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_permission_errors_fail_at_once(server: HubServer) -> None:
    make_run(server)
    alice = make_bus(server, ALICE)
    before = len(server.state.requests)
    with pytest.raises(PermissionDenied, match=r"owner/run: write .* missing permission \(HTTP 403"):
        alice.write_manifest({"format": 1})
    assert len(server.state.requests) - before <= 2  # preupload refused once; no retry loop


def test_hung_requests_time_out_and_are_retried(server: HubServer) -> None:
    bus = make_run(server)
    bus.publish(b"g", {"outer_step": 5})
    server.hang_next(1, 5.0)
    assert bus.read_head()["outer_step"] == 5
    server.hang_next(10, 5.0)
    with pytest.raises(TransientBusError, match=r"timed out|Timeout"):
        bus.read_head()


def test_compact_squashes_the_run_history(server: HubServer) -> None:
    bus = make_run(server)
    for step in range(3):
        bus.publish(b"g%d" % step, {"outer_step": step})
    assert len(server.state.repos["owner/run"].commits) > 3
    bus.compact()
    assert len(server.state.repos["owner/run"].commits) == 1
    assert bus.read_head()["outer_step"] == 2


def test_one_listing_call_per_poll_and_only_changed_repos_are_reread(server: HubServer) -> None:
    """Delta repos carry the run's tag; a poll is one `list_models` call plus one tree listing per
    repo whose head moved, whatever the number of collaborators."""
    owner = make_run(server)
    owner.check_master_access()  # tags the run repo (a run created before tags gets it here)
    alice = make_bus(server, ALICE)
    alice.check_worker_access("alice")  # creates alice/run-deltas with the run's tag
    alice.put_delta("alice", "alice--00000000.safetensors", b"d0")
    assert [r.name for r in owner.list_deltas(None)] == ["alice--00000000.safetensors"]
    before = len(server.state.requests)
    assert [r.name for r in owner.list_deltas(None)] == ["alice--00000000.safetensors"]
    assert [p for _, p in server.state.requests[before:]] == [
        p for _, p in server.state.requests[before:] if p.startswith("/api/models?")
    ] and len(server.state.requests) - before == 1  # nothing changed: the listing alone
    alice.put_delta("alice", "alice--00000001.safetensors", b"d1")
    before = len(server.state.requests)
    refs = owner.list_deltas(None)
    assert len(server.state.requests) - before == 2  # the listing, then alice's tree at its new sha
    assert owner.get_delta(refs[-1], 100) == b"d1"


def test_repos_that_moved_together_are_listed_side_by_side(server: HubServer) -> None:
    """A round's deltas land together, one commit per node's repo: their tree listings run side by
    side (a barrier that one listing after another would break), and a listing that fails there is
    asked again in the poll itself."""
    tokens = {"alice": ALICE, "bob": "hf_bobbusunit00000003", "carol": "hf_carolbusunit000004"}
    server.state.add_user("bob", tokens["bob"])
    server.state.add_user("carol", tokens["carol"])
    owner = make_bus(server, OWNER)
    owner.api.create_repo("owner/run", private=False)
    owner.write_manifest({"format": 1, "collaborators": {u: {"user": u, "delta_repo": None} for u in tokens}})
    owner.check_master_access()
    nodes = {u: make_bus(server, t) for u, t in tokens.items()}
    for user, bus in nodes.items():
        bus.check_worker_access(user)
        bus.put_delta(user, f"{user}--00000000.safetensors", user.encode())
    barrier = threading.Barrier(3, timeout=20)
    listed: list[str] = []
    original = owner.api.list_repo_tree

    def list_repo_tree(repo: str, *args: object, **kwargs: object) -> object:
        listed.append(repo)
        barrier.wait()
        return original(repo, *args, **kwargs)

    owner.api.list_repo_tree = list_repo_tree  # type: ignore[method-assign]
    refs = owner.list_deltas(None)
    assert sorted(r.node for r in refs) == sorted(tokens) and sorted(listed) == sorted(
        f"{u}/run-deltas" for u in tokens
    ), (refs, listed)

    failed: list[str] = []

    def flaky(repo: str, *args: object, **kwargs: object) -> object:
        if repo == "bob/run-deltas" and not failed:
            failed.append(repo)
            raise PermissionDenied("bob/run-deltas: a listing refused once")
        return original(repo, *args, **kwargs)

    owner.api.list_repo_tree = flaky  # type: ignore[method-assign]
    for user, bus in nodes.items():
        bus.put_delta(user, f"{user}--00000001.safetensors", user.encode())
    refs = owner.list_deltas(None)
    assert failed == ["bob/run-deltas"] and sorted(r.name for r in refs if r.node == "bob") == [
        "bob--00000000.safetensors",
        "bob--00000001.safetensors",
    ], refs


def test_429s_from_the_request_window_are_waited_out_never_fatal(
    server: HubServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A client whose budget is wrong (here: 10× the server's) meets the server's window; every 429
    is waited out, beyond retry_attempts, and the reads succeed."""
    bus = make_run(server)
    bus.publish(b"g", {"outer_step": 3})
    reader = make_bus(server, ALICE, retry_attempts=0, hub_request_budget=200, hub_request_window=2.0)
    server.limit_requests(6, 2.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(10):  # 3 requests the first time, 1 after (the commit does not change)
            assert reader.read_head()["outer_step"] == 3
    assert any(who == "alice" for who, _ in server.state.throttled)


def test_the_client_paces_commits_under_the_repo_commit_budget(server: HubServer) -> None:
    server.limit_commits(4, 2.0)
    alice = make_bus(server, ALICE, hub_commit_budget=4, hub_commit_window=2.0)
    alice.api.create_repo("alice/pace")
    started = time.monotonic()
    for i in range(8):
        alice._commit("alice/pace", [CommitOperationAdd(f"f{i}", b"x")], f"commit {i}")
    assert not server.state.throttled  # paced: no 429
    assert time.monotonic() - started >= 1.5  # 8 commits at 4 per 2 s


def test_hub_status_gives_up_within_its_retry_budget(server: HubServer) -> None:
    from speedtronic.diloco.launch import run_status
    from speedtronic.errors import TransientBusError

    make_run(server).publish(b"g", {"outer_step": 1})
    server.stop()
    started = time.monotonic()
    with pytest.raises(TransientBusError):
        run_status("owner/run", server.url, retry_budget_s=2.0)
    assert time.monotonic() - started < 6.0


def test_a_head_poll_at_an_unchanged_commit_downloads_nothing(server: HubServer) -> None:
    """A waiting worker polls head.json ~10 times a second: at the commit whose head it read last, a
    poll is the one request that tells the commit, and head.json is downloaded again only after a new
    commit (then the new head's content, never the remembered one)."""
    bus = make_run(server)
    bus.publish(b"g0", {"outer_step": 0})
    first = bus.read_head()
    assert first is not None and first["outer_step"] == 0

    def head_downloads() -> int:
        return sum(1 for _, path in server.state.requests if path.split("?")[0].endswith("/head.json"))

    before = head_downloads()
    for _ in range(5):
        again = bus.read_head()
        assert again == first and again.version == first.version
    assert head_downloads() == before
    again["outer_step"] = 99  # a caller's change to its copy is not what the next poll reads
    assert bus.read_head()["outer_step"] == 0
    bus.publish(b"g1", {"outer_step": 1}, expected=first)
    moved = bus.read_head()
    assert moved is not None and moved["outer_step"] == 1 and moved.version != first.version
    assert head_downloads() > before


def test_safetensors_go_up_as_lfs_objects_when_the_hub_asks_for_lfs(
    server: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hub answers "lfs" for safetensors: deltas, globals and updates are then PUT raw (the LFS batch
    API) and the commit names them by sha256; every read gives back exactly the bytes sent, the size cap
    still holds, and no safetensors file rides in a commit body as base64."""
    import hashlib
    import json

    import httpx

    lfs_on(server, monkeypatch)
    bodies: list[tuple[str, str, bytes]] = []  # every request's body, to see what the commits carried
    original = hub_server.Handler._body

    def record(handler: hub_server.Handler) -> bytes:
        body = original(handler)
        bodies.append((handler.command, handler.path, body))
        return body

    monkeypatch.setattr(hub_server.Handler, "_body", record)
    owner = make_run(server)
    alice = make_bus(server, ALICE)
    alice.check_worker_access("alice")
    delta = bytes(range(256)) * 40
    alice.put_delta("alice", "alice--00000000.safetensors", delta)
    (ref,) = owner.list_deltas(None)
    assert owner.get_delta(ref, 1 << 20) == delta
    full, update = b"\x01" * 5000, b"\x02" * 1200
    head = owner.publish(full, {"outer_step": 1}, update=update)
    assert owner.read_global_capped(head, 5000) == full and owner.read_update_capped(head, 1200) == update
    with pytest.raises(GlobalTooLarge, match="is 5,000 bytes"):
        owner.read_global_capped(head, 4999)
    sent = {hashlib.sha256(x).hexdigest() for x in (delta, full, update)}
    assert sent == set(server.state.lfs_uploads) == set(server.state.lfs_objects)  # each uploaded once
    ops = [
        json.loads(line)
        for method, path, body in bodies
        if method == "POST" and "/commit/" in path
        for line in body.splitlines()
        if line.strip()
    ]
    inline = [op["value"]["path"] for op in ops if op["key"] == "file"]
    by_lfs = [op["value"]["path"] for op in ops if op["key"] == "lfsFile"]
    assert len(by_lfs) == 3 and not [p for p in inline if p.endswith(".safetensors")], (inline, by_lfs)
    # The server keeps only bytes that hash to the oid they were sent for.
    wrong = httpx.put(f"{server.url}/lfs-upload/{'0' * 64}", content=b"not that")
    assert wrong.status_code == 400 and "0" * 64 not in server.state.lfs_objects


def test_an_lfs_upload_that_fails_with_a_5xx_is_retried_as_transient(
    server: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub wraps a failed LFS upload in RuntimeError("Error while uploading …") raised from
    the HTTP error: a 503 from the storage is transient (retried by the bus), not a permanent failure.
    The client's own backoff is cut to one try so the bus's retry is what is tested."""
    import functools

    import huggingface_hub.lfs as lfs

    monkeypatch.setattr(lfs, "http_backoff", functools.partial(lfs.http_backoff, max_retries=0))
    lfs_on(server, monkeypatch)
    owner = make_run(server)
    alice = make_bus(server, ALICE)
    alice.check_worker_access("alice")
    server.fail_next(2, 503, match="/lfs-upload/")
    alice.put_delta("alice", "alice--00000000.safetensors", b"delta" * 100)
    (ref,) = owner.list_deltas(None)
    assert owner.get_delta(ref, 1 << 20) == b"delta" * 100
    server.fail_next(1, 400, match="/lfs-upload/")  # a refusal is not retried: one line, no traceback
    with pytest.raises(BusError, match="HTTP 400") as refused:
        alice.put_delta("alice", "alice--00000001.safetensors", b"other" * 100)
    assert not isinstance(refused.value, TransientBusError)


def test_a_commit_whose_answer_was_lost_is_retried_with_the_objects_already_stored(
    server: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client marks an LFS object uploaded and does not send it again when the commit is retried
    (its answer lost): the storage keeps every object, as the Hub's does, so the retry lands."""
    lfs_on(server, monkeypatch)
    owner = make_run(server)
    alice = make_bus(server, ALICE)
    alice.check_worker_access("alice")
    server.hang_after_next(1, 3.0, match="/commit/")  # past request_timeout: the answer never comes
    alice.put_delta("alice", "alice--00000000.safetensors", b"kept" * 500)
    (ref,) = owner.list_deltas(None)
    assert owner.get_delta(ref, 1 << 20) == b"kept" * 500
    assert len(server.state.lfs_uploads) == 1  # sent once, committed twice
