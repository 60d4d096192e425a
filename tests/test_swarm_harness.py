"""The swarm harness's exactly-once check (tests/swarm_harness.py) on reports built by hand: it must
fail on each way a delta can go wrong, and its message must carry the full lists. Also its bus view
of a directory bus and of the loopback Hub (real files, a real server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hub_server import HubServer
from speedtronic.diloco import codec
from speedtronic.diloco.bus.directory import DirectoryBus
from swarm_harness import Report, Swarm, assert_exactly_once, hub_delta_ids


def ids(node: str, *seqs: int) -> list[str]:
    return [f"{node}/{codec.delta_name(node, s)}" for s in seqs]


def report(**kw: object) -> Report:
    base: dict[str, object] = {
        "sent": {"a": ids("a", 0, 1), "b": ids("b", 0)},
        "seen": dict.fromkeys([*ids("a", 0, 1), *ids("b", 0)], 1.0),
        "applied": [*ids("a", 0, 1), *ids("b", 0)],
        "rejected": [],
        "remaining": [],
        "killed": {},
    }
    base.update(kw)
    return Report(**base)  # type: ignore[arg-type]


def test_a_clean_run_passes() -> None:
    assert_exactly_once(report(), allow_left=False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"applied": [*ids("a", 0, 1, 1), *ids("b", 0)]}, "applied more than once: ['a/a--00000001"),
        ({"applied": ids("a", 0, 1)}, "lost: ['b/b--00000000"),
        ({"applied": [*ids("a", 0, 1), *ids("b", 0), *ids("c", 0)]}, "applied, sent by no one: ['c/c"),
        ({"rejected": [{"id": ids("b", 0)[0], "reason": ""}], "applied": ids("a", 0, 1)}, "without a reason"),
        ({"clashes": ids("a", 1)}, "two processes at once: ['a/a--00000001"),
    ],
)
def test_each_violation_fails_with_the_full_lists(change: dict[str, object], message: str) -> None:
    with pytest.raises(AssertionError) as failure:
        assert_exactly_once(report(**change))
    text = str(failure.value)
    assert message in text, text
    for line in ("sent (reported by exited lives):", "applied (", "rejected:", "remaining on the bus:"):
        assert line in text


def test_what_is_accounted_for_passes() -> None:
    """Rejected with a reason, or still on the bus; a killed node's delta that only the master knows."""
    r = report(
        applied=[*ids("a", 0), *ids("k", 0)],
        rejected=[{"id": ids("a", 1)[0], "reason": "stale: built on outer step 0"}],
        remaining=ids("b", 0),
        killed={"k": 1},
    )
    assert_exactly_once(r)
    with pytest.raises(AssertionError, match="left unprocessed"):
        assert_exactly_once(r, allow_left=False)


def test_the_watcher_sees_what_lands_on_a_directory_bus(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path)
    try:
        bus = DirectoryBus(swarm.repo.removeprefix("file://"))
        bus.create_run()
        bus.put_delta("w1", codec.delta_name("w1", 0), b"x" * 10)
        (tmp_path / "bus" / "deltas" / "w1" / "w1--00000007.safetensors").symlink_to(tmp_path)
        assert swarm.delta_files() == set(ids("w1", 0))  # a link is not an upload
        swarm._stop.wait(0.2)
        assert set(swarm.seen) == set(ids("w1", 0))
    finally:
        swarm.close()


@pytest.mark.usefixtures("isolated_env")
def test_the_hub_view_keeps_every_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    try:
        server.state.add_user("u", "hf_uharnesstoken00000000")
        api = HfApi(endpoint=server.url, token="hf_uharnesstoken00000000")
        api.create_repo("u/d", private=False)
        path = f"deltas/u/{codec.delta_name('u', 0)}"
        api.upload_file(path_or_fileobj=b"x", path_in_repo=path, repo_id="u/d")
        api.delete_file(path, repo_id="u/d")
        assert hub_delta_ids(server) == set()
        assert hub_delta_ids(server, history=True) == set(ids("u", 0))
    finally:
        server.stop()


def test_the_summaries_only_check_names_the_extra_delta() -> None:
    """test_diloco_multiprocess.assert_exactly_once (master summary + worker summaries, for tests that
    drive processes by hand) fails naming the delta no worker reported."""
    from test_diloco_multiprocess import assert_exactly_once as from_summaries

    master = {"applied": [*ids("a", 0, 1)], "rejected": []}
    from_summaries(master, {"node": "a", "uploaded": [codec.delta_name("a", s) for s in (0, 1)]})
    with pytest.raises(AssertionError, match=r"sent by no one: \['a/a--00000001"):
        from_summaries(master, {"node": "a", "uploaded": [codec.delta_name("a", 0)]})
