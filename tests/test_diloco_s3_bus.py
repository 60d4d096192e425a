"""The S3 bus (speedtronic/diloco/bus/s3.py) against a real moto S3 server on 127.0.0.1: every protocol
method, the races conditional writes decide (deltas, publishes, leases), hostile keys under deltas/,
real 403s from moto's IAM checks with the secret key never in a message or a log line, and the
boto3-less install's one-line error."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("boto3", reason="the S3 bus tests need boto3 (pip install -e '.[dev]')")
pytest.importorskip("moto", reason="the S3 bus tests need moto[server] (pip install -e '.[dev]')")
pytest.importorskip("flask", reason="moto's server needs moto[server] (flask)")

from botocore.exceptions import ClientError, ReadTimeoutError

from s3_server import ACCESS_KEY, SECRET_KEY, S3Server, free_port
from speedtronic.diloco.bus.base import ClaimHeld, DeltaRef, Head, HeadMoved
from speedtronic.diloco.bus.registry import open_bus
from speedtronic.diloco.bus.s3 import S3Bus
from speedtronic.diloco.bus.s3_client import classify
from speedtronic.errors import BusError, ConfigError, PermissionDenied, TransientBusError

pytestmark = pytest.mark.usefixtures("restore_secrets")
FAST = {"retry_initial": 0.01, "retry_max": 0.05, "retry_attempts": 2, "request_timeout": 10.0}


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    s3 = S3Server()
    yield s3
    s3.stop()


@pytest.fixture(autouse=True)
def aws_env(server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Test credentials in the environment, the loopback endpoint, and no ~/.aws of the machine's."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


_buckets = iter(range(1, 1 << 20))


@pytest.fixture
def bucket(server: S3Server) -> str:
    name = f"run-bucket-{next(_buckets)}"
    server.admin().create_bucket(Bucket=name)
    return name


@pytest.fixture
def make_bus(bucket: str) -> Callable[..., S3Bus]:
    def make(prefix: str = "run", **settings: Any) -> S3Bus:
        bus = open_bus(f"s3://{bucket}/{prefix}", **{**FAST, **settings})
        assert isinstance(bus, S3Bus)
        return bus

    return make


def keys(server: S3Server, bucket: str, prefix: str = "") -> list[str]:
    listed = server.admin().list_objects_v2(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def head_doc(step: int) -> dict[str, Any]:
    return {"format": 1, "outer_step": step, "updated_at": f"t{step}", "hwm": {}, "nodes": {}}


def race(*fns: Callable[[], Any]) -> list[Any]:
    """Run the calls at once (a barrier releases them together); each one's result or exception."""
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = fns[i]()
        except Exception as error:
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# -- opening a bus ------------------------------------------------------------------------------------
def test_importing_the_bus_does_not_import_boto3() -> None:
    code = (
        "import sys, speedtronic.diloco.bus.s3, speedtronic.diloco.bus.registry\n"
        "assert 'boto3' not in sys.modules and 'botocore' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_boto3_opening_an_s3_run_is_one_config_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # `import boto3` now raises ImportError
    with pytest.raises(ConfigError) as caught:
        open_bus("s3://bkt/run")
    assert caught.value.exit_code == 2
    assert 'pip install "speedtronic-lm[s3]"' in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "url",
    ["s3://", "s3:///run", "s3://a/run", "s3://bkt/../x", "s3://bkt/a//b", "s3://bkt/a b", "s3://b/k\n"],
)
def test_bad_run_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError, match=r"s3://BUCKET/PREFIX|prefix must be"):
        open_bus(url)


def test_url_and_repr_name_no_credential(make_bus: Callable[..., S3Bus], bucket: str) -> None:
    bus = make_bus("team/run1/")
    assert bus.url == f"s3://{bucket}/team/run1" and bus.scheme == "s3" and bus.creates_on_master_start
    assert SECRET_KEY not in repr(bus) and ACCESS_KEY not in repr(bus) and repr(bus) == f"S3Bus({bus.url!r})"
    assert bus.poll_delay(3.5, 100.0) == 3.5  # no request budget to stretch the interval for


def test_endpoint_order_argument_then_config_then_environment(
    server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    config = SimpleNamespace(
        endpoint=None, retry_initial=0.01, retry_max=0.02, retry_attempts=1, request_timeout=5.0
    )
    with pytest.raises(TransientBusError, match=r"talking to http://127\.0\.0\.1"):
        open_bus(f"s3://{bucket}/run", config=config).read_manifest()  # the environment's (dead) one
    config.endpoint = server.url
    assert open_bus(f"s3://{bucket}/run", config=config).read_manifest() is None
    config.endpoint = dead
    assert open_bus(f"s3://{bucket}/run", config=config, endpoint=server.url).read_manifest() is None
    with pytest.raises(ConfigError, match="holds credentials") as caught:
        open_bus(f"s3://{bucket}/run", endpoint="http://user:hunter22@127.0.0.1:9")
    assert "hunter22" not in str(caught.value)


# -- the run and its documents --------------------------------------------------------------------
def test_create_run_checks_the_bucket_and_refuses_an_existing_run(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str
) -> None:
    missing = open_bus("s3://no-such-bucket-here/run", **FAST)
    with pytest.raises(BusError, match="'no-such-bucket-here' does not exist"):
        missing.create_run()
    bus = make_bus()
    assert bus.create_run() == {"owner": None, "private": None, "gated": None}
    assert keys(server, bucket) == []  # the probes are gone
    assert bus.read_manifest() is None and bus.read_head() is None
    bus.write_manifest({"format": 1, "fingerprint": "abc"})
    assert bus.read_manifest() == {"format": 1, "fingerprint": "abc"}
    with pytest.raises(BusError, match="already holds a DiLoCo run"):
        make_bus().create_run()
    make_bus("other-run").create_run()  # another prefix of the same bucket is free
    bus.check_master_access()


def test_create_run_refuses_a_store_that_ignores_if_none_match(make_bus: Callable[..., S3Bus]) -> None:
    """A store that drops the conditional headers (an old MinIO, a proxy) would let two writers win."""
    bus = make_bus()

    def drop_condition(request: Any, **_: Any) -> None:
        if "If-None-Match" in request.headers:
            del request.headers["If-None-Match"]

    bus.client.meta.events.register("before-sign.s3.PutObject", drop_condition)
    with pytest.raises(BusError, match="does not enforce If-None-Match"):
        bus.create_run()


def test_publish_read_head_and_global(make_bus: Callable[..., S3Bus], server: S3Server, bucket: str) -> None:
    bus = make_bus()
    first = bus.publish(b"global-0", head_doc(0))
    assert first["global"] == "global/outer_00000000.safetensors" and first.version.startswith('"')
    head = bus.read_head()
    assert head == first and head.version == first.version and bus.read_global(head) == b"global-0"
    with pytest.raises(HeadMoved):
        bus.publish(b"again", head_doc(0))  # expected=None: only for the first head
    second = bus.publish(b"global-1", head_doc(1), expected=head)
    assert bus.read_head().version == second.version != head.version
    assert bus.read_global(bus.read_head()) == b"global-1"
    with pytest.raises(HeadMoved):
        bus.publish(b"stale", head_doc(2), expected=head)
    assert bus.read_head()["outer_step"] == 1
    with pytest.raises(BusError, match="not a global model file"):
        bus.read_global(Head({"global": "../manifest.json"}, "x"))


def test_a_head_poll_at_an_unchanged_etag_downloads_nothing(make_bus: Callable[..., S3Bus]) -> None:
    """A worker waiting for a global polls head.json ~10 times a second: at the ETag it read last, the
    store answers 304 without a body (If-None-Match), and a moved head is read whole again."""
    bus, master = make_bus(), make_bus()
    master.publish(b"global-0", head_doc(0))
    answers: list[tuple[str | None, int]] = []
    original = bus.client.get_object

    def get_object(**kwargs: Any) -> Any:
        try:
            response = original(**kwargs)
        except ClientError as error:
            answers.append((kwargs.get("IfNoneMatch"), error.response["ResponseMetadata"]["HTTPStatusCode"]))
            raise
        answers.append((kwargs.get("IfNoneMatch"), 200))
        return response

    bus.client.get_object = get_object
    first = bus.read_head()
    again = bus.read_head()
    assert again == first and again.version == first.version and again["outer_step"] == 0
    assert answers == [(None, 200), (first.version, 304)], answers
    master.publish(b"global-1", head_doc(1), expected=master.read_head())
    moved = bus.read_head()
    assert moved["outer_step"] == 1 and moved.version != first.version
    assert answers[-1] == (first.version, 200) and bus.read_global(moved) == b"global-1"


def test_moto_enforces_the_conditional_requests_this_bus_relies_on(server: S3Server, bucket: str) -> None:
    admin = server.admin()

    def status(call: Callable[[], Any]) -> int:
        try:
            call()
            return 200
        except ClientError as error:
            return int(error.response["ResponseMetadata"]["HTTPStatusCode"])

    first = admin.put_object(Bucket=bucket, Key="k", Body=b"1", IfNoneMatch="*")["ETag"]
    assert status(lambda: admin.put_object(Bucket=bucket, Key="k", Body=b"2", IfNoneMatch="*")) == 412
    assert status(lambda: admin.put_object(Bucket=bucket, Key="k", Body=b"2", IfMatch='"00"')) == 412
    assert status(lambda: admin.get_object(Bucket=bucket, Key="k", IfMatch='"00"')) == 412
    assert status(lambda: admin.delete_object(Bucket=bucket, Key="k", IfMatch='"00"')) == 412
    assert status(lambda: admin.put_object(Bucket=bucket, Key="k", Body=b"3", IfMatch=first)) == 200
    assert admin.get_object(Bucket=bucket, Key="k")["Body"].read() == b"3"


def test_a_head_that_moves_after_the_check_is_caught_by_if_match(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str
) -> None:
    """A rival's head lands between this master's check and its conditional PUT of head.json."""
    bus = make_bus()
    head = bus.publish(b"g0", head_doc(0))
    rival = {"n": 0}

    def rival_first(params: Any, **_: Any) -> None:
        if params["Key"].endswith("head.json") and rival["n"] == 0:
            rival["n"] += 1
            server.admin().put_object(
                Bucket=bucket, Key=params["Key"], Body=b'{"outer_step": 1, "by": "rival"}'
            )

    bus.client.meta.events.register("provide-client-params.s3.PutObject", rival_first)
    with pytest.raises(HeadMoved):
        bus.publish(b"g1", head_doc(1), expected=head)
    assert rival["n"] == 1 and bus.read_head()["by"] == "rival"


def test_two_masters_publishing_from_one_head_exactly_one_wins(make_bus: Callable[..., S3Bus]) -> None:
    bus_a, bus_b = make_bus(), make_bus()
    base = bus_a.publish(b"g0", head_doc(0))
    for step in range(1, 6):
        results = race(
            lambda step=step, base=base: bus_a.publish(
                b"from-a", head_doc(step) | {"by": "a"}, expected=base
            ),
            lambda step=step, base=base: bus_b.publish(
                b"from-b", head_doc(step) | {"by": "b"}, expected=base
            ),
        )
        won = [r for r in results if isinstance(r, Head)]
        lost = [r for r in results if isinstance(r, HeadMoved)]
        assert len(won) == 1 and len(lost) == 1, results
        base = bus_a.read_head()
        assert base.version == won[0].version and base["by"] == won[0]["by"]
        assert bus_b.read_global(base) == f"from-{base['by']}".encode()  # never a torn pair


def test_a_global_left_by_a_killed_master_is_never_overwritten(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str
) -> None:
    bus = make_bus()
    head = bus.publish(b"g0", head_doc(0))
    server.admin().put_object(Bucket=bucket, Key="run/global/outer_00000001.safetensors", Body=b"orphan")
    new = bus.publish(b"g1", head_doc(1), expected=head)
    assert new["global"].startswith("global/outer_00000001.") and new["global"] != head["global"]
    assert bus.read_global(bus.read_head()) == b"g1"
    orphan = server.admin().get_object(Bucket=bucket, Key="run/global/outer_00000001.safetensors")
    assert orphan["Body"].read() == b"orphan"
    # The same bytes under the plain name (our own write answered late) are taken as ours.
    server.admin().put_object(Bucket=bucket, Key="run/global/outer_00000002.safetensors", Body=b"g2")
    assert bus.publish(b"g2", head_doc(2), expected=new)["global"] == "global/outer_00000002.safetensors"


def test_a_head_write_whose_answer_was_lost_is_not_taken_for_a_rival(make_bus: Callable[..., S3Bus]) -> None:
    bus = make_bus()
    head = bus.publish(b"g0", head_doc(0))
    # The global PUT goes first; lose the answer of the second PUT (head.json) after it landed.
    calls = {"n": 0}

    def after_put(**kwargs: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise ReadTimeoutError(endpoint_url="http://lost")

    bus.client.meta.events.register("after-call.s3.PutObject", after_put)
    new = bus.publish(b"g1", head_doc(1), expected=head)
    assert calls["n"] >= 3 and bus.read_head().version == new.version and new["outer_step"] == 1


def test_publish_prunes_only_the_globals_it_is_told_to(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str
) -> None:
    """Only the keys in `prune` (the master's own, as its heads named them) are deleted: junk named
    like a global, a killed master's orphan under a plain name, and anything else in global/ stay."""
    bus = make_bus()
    bus.write_manifest({"format": 1})
    for key in ("outer_00000099.safetensors", "outer_99999999.safetensors", "notes.txt"):
        server.admin().put_object(Bucket=bucket, Key=f"run/global/{key}", Body=b"junk")
    server.admin().put_object(Bucket=bucket, Key="run/global/outer_00000001.safetensors", Body=b"orphan")
    head, own = None, []
    for step in range(6):
        prune = [path for s, path in own if s <= step - 3]
        head = bus.publish(b"g%d" % step, head_doc(step), expected=head, prune=prune)
        own = [(s, path) for s, path in own if path not in prune] + [(step, head["global"])]
        assert bus.read_global(bus.read_head()) == b"g%d" % step
    assert own[0][1].startswith("global/outer_00000003.")
    assert keys(server, bucket, "run/global/") == [
        "run/global/notes.txt",
        "run/global/outer_00000001.safetensors",  # not this master's: its step 1 went elsewhere
        "run/global/outer_00000003.safetensors",
        "run/global/outer_00000004.safetensors",
        "run/global/outer_00000005.safetensors",
        "run/global/outer_00000099.safetensors",
        "run/global/outer_99999999.safetensors",
    ]
    # Keys outside global/ (or the one being written) are never deleted, whatever a caller names.
    bus.publish(b"g6", head_doc(6), expected=head, prune=["manifest.json", "../run/head.json", "global/x"])
    assert bus.read_head()["outer_step"] == 6 and bus.read_manifest() is not None


# -- deltas ---------------------------------------------------------------------------------------
def test_deltas_put_list_get_delete(make_bus: Callable[..., S3Bus], server: S3Server, bucket: str) -> None:
    bus = make_bus()
    bus.check_worker_access("w1")
    assert bus.list_own_deltas("w1") == [] and not bus.delta_exists("w1", "w1--00000000.safetensors")
    bus.put_delta("w1", "w1--00000000.safetensors", b"d0")
    bus.put_delta("w1", "w1--00000001.safetensors", b"d1-longer")
    bus.put_delta("w2", "w2--00000000.safetensors", b"e0")
    assert bus.delta_exists("w1", "w1--00000000.safetensors")
    assert bus.list_own_deltas("w1") == ["w1--00000000.safetensors", "w1--00000001.safetensors"]
    refs = bus.list_deltas(None)
    assert sorted(r.id for r in refs) == [
        "w1/w1--00000000.safetensors",
        "w1/w1--00000001.safetensors",
        "w2/w2--00000000.safetensors",
    ]
    by_id = {r.id: r for r in refs}
    ref = by_id["w1/w1--00000001.safetensors"]
    assert ref.size == 9 and ref.where == "run/deltas/w1/w1--00000001.safetensors" and ref.etag
    assert bus.get_delta(ref, 100) == b"d1-longer"
    assert bus.get_delta(ref, 4) == b"d1-lo"  # max_bytes + 1: a ranged GET, the decoder says "too big"
    assert [r.node for r in bus.list_deltas({"w2": {}})] == ["w2"]
    bus.delete_deltas([ref])
    assert not bus.delta_exists("w1", "w1--00000001.safetensors")
    with pytest.raises(BusError, match="disappeared"):
        bus.get_delta(ref, 100)
    # A worker's next upload prunes its processed deltas.
    bus.put_delta("w1", "w1--00000002.safetensors", b"d2", prune=["w1--00000000.safetensors"])
    assert bus.list_own_deltas("w1") == ["w1--00000002.safetensors"]
    with pytest.raises(BusError, match="refusing"):
        bus.get_delta(DeltaRef("w1", "w1--00000002.safetensors", 2, "run/manifest.json"), 100)
    with pytest.raises(BusError, match="refusing delta name"):
        bus.put_delta("w1", "../w1--00000003.safetensors", b"x")
    with pytest.raises(BusError, match="invalid node id"):
        bus.put_delta("../w1", "w1--00000003.safetensors", b"x")


def test_processed_deltas_go_in_one_delete_objects_request(
    make_bus: Callable[..., S3Bus], caplog: pytest.LogCaptureFixture
) -> None:
    """The master's round deletes its processed deltas in one DeleteObjects request (each DELETE was
    retried on its own through a storm and held the next round back); a store that answers
    NotImplemented gets one DELETE per key from then on; keys it could not delete are warned about."""
    bus = make_bus()
    for node in ("w1", "w2", "w3"):
        for seq in range(3):
            bus.put_delta(node, f"{node}--{seq:08d}.safetensors", b"d")
    calls: list[str] = []
    bus.client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    refs = bus.list_deltas(None)
    calls.clear()
    bus.delete_deltas([r for r in refs if r.node != "w3"])
    assert calls == ["DeleteObjects"]
    assert [r.node for r in bus.list_deltas(None)] == ["w3"] * 3

    def answer_errors(parsed: dict[str, Any], **_: Any) -> None:
        parsed["Errors"] = [{"Key": "run/deltas/w3/w3--00000000.safetensors", "Code": "AccessDenied"}]

    bus.client.meta.events.register("after-call.s3.DeleteObjects", answer_errors)
    with caplog.at_level("WARNING", logger="speedtronic.diloco"):
        bus.delete_deltas([r for r in bus.list_deltas(None) if r.name.endswith("0.safetensors")])
    assert "1 of 1 processed deltas not deleted" in caplog.text and "AccessDenied" in caplog.text
    bus.client.meta.events.unregister("after-call.s3.DeleteObjects", answer_errors)

    def no_batches(params: Any, **_: Any) -> None:
        raise ClientError(
            {
                "Error": {"Code": "NotImplemented", "Message": "no"},
                "ResponseMetadata": {"HTTPStatusCode": 501},
            },
            "DeleteObjects",
        )

    bus.client.meta.events.register("provide-client-params.s3.DeleteObjects", no_batches)
    ones = [r for r in bus.list_deltas(None) if r.name.endswith("1.safetensors")]
    calls.clear()
    bus.delete_deltas(ones)
    assert calls == ["DeleteObject"] and sorted(r.name[-13:] for r in bus.list_deltas(None)) == [
        "2.safetensors"
    ]
    twos = bus.list_deltas(None)
    calls.clear()
    bus.delete_deltas(twos)  # remembered: no DeleteObjects tried again
    assert calls == ["DeleteObject"] and bus.list_deltas(None) == []


def test_listing_follows_every_page(make_bus: Callable[..., S3Bus]) -> None:
    bus = make_bus()
    names = [f"w{i % 3}--{i:08d}.safetensors" for i in range(7)]
    for name in names:
        bus.put_delta(name.split("--")[0], name, name.encode())
    bus.page_size = 2
    pages = []
    bus.client.meta.events.register("before-call.s3.ListObjectsV2", lambda **kw: pages.append(1))
    assert sorted(r.name for r in bus.list_deltas(None)) == sorted(names)
    assert len(pages) == 4  # 7 keys, 2 a page
    assert bus.list_own_deltas("w1") == sorted(n for n in names if n.startswith("w1--"))


def test_a_delta_is_written_once(make_bus: Callable[..., S3Bus], server: S3Server, bucket: str) -> None:
    bus = make_bus()
    bus.put_delta("w1", "w1--00000000.safetensors", b"first")
    bus.put_delta("w1", "w1--00000000.safetensors", b"first")  # a retry after a lost answer: fine
    with pytest.raises(BusError, match="already holds different bytes"):
        bus.put_delta("w1", "w1--00000000.safetensors", b"other")
    stored = server.admin().get_object(Bucket=bucket, Key="run/deltas/w1/w1--00000000.safetensors")
    assert stored["Body"].read() == b"first"


def test_two_writers_of_one_delta_name_exactly_one_version_stands(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str
) -> None:
    one, two = make_bus(), make_bus()
    for seq in range(8):
        name = f"w1--{seq:08d}.safetensors"
        data = {0: b"A" * 100_000 + bytes([seq]), 1: b"B" * 100_000 + bytes([seq])}
        results = race(
            lambda name=name, data=data: one.put_delta("w1", name, data[0]),
            lambda name=name, data=data: two.put_delta("w1", name, data[1]),
        )
        ok = [i for i, r in enumerate(results) if r is None]
        failed = [r for r in results if isinstance(r, BusError)]
        assert len(ok) == 1 and len(failed) == 1, results
        assert "already holds different bytes" in str(failed[0])
        stored = server.admin().get_object(Bucket=bucket, Key=f"run/deltas/w1/{name}")["Body"].read()
        assert stored == data[ok[0]]


def test_hostile_keys_under_deltas_are_skipped_once(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    bus = make_bus()
    bus.put_delta("w1", "w1--00000000.safetensors", b"ok")
    admin = server.admin()
    for key in [
        "run/deltas/stray.safetensors",  # not under a node folder
        "run/deltas/w1/sub/w1--00000001.safetensors",  # too deep
        "run/deltas/bad node/x.safetensors",  # not a node id
        "run/deltas/-w/x.safetensors",
        "run/deltas/w1/.probe-dead",  # a probe a worker left: silently ignored
        "run/deltas/w1/",  # a console's folder marker
        "run/deltas/bad\u2028node/x",  # a line separator: logged as an escape, never raw
        "run/deltas/w1/\x7f",  # an unprintable name
        "run/deltas/w2/evil name;rm.safetensors",  # listed as is: the name is the decoder's to refuse
    ]:
        admin.put_object(Bucket=bucket, Key=key, Body=b"x")
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        first = sorted(r.id for r in bus.list_deltas(None))
        second = sorted(r.id for r in bus.list_deltas(None))
    assert first == second == ["w1/w1--00000000.safetensors", "w2/evil name;rm.safetensors"]
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 6, skipped  # once each, never on the second poll
    assert all("\u2028" not in m and "\x7f" not in m for m in skipped)


def test_a_delta_replaced_after_listing_is_refused(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str
) -> None:
    bus = make_bus()
    bus.put_delta("w1", "w1--00000000.safetensors", b"listed")
    [ref] = bus.list_deltas(None)
    server.admin().put_object(Bucket=bucket, Key=ref.where, Body=b"swapped in")
    with pytest.raises(BusError, match="replaced since it was listed"):
        bus.get_delta(ref, 100)


# -- leases ---------------------------------------------------------------------------------------
def test_leases_claim_renew_hold_expire_release(make_bus: Callable[..., S3Bus]) -> None:
    bus = make_bus()
    claim = bus.claim("master", "host-a:1", 60.0)
    assert claim.holder == "host-a:1" and claim.version
    renewed = bus.claim("master", "host-a:1", 60.0)
    assert renewed.version != claim.version
    with pytest.raises(ClaimHeld) as held:
        bus.claim("master", "host-b:2", 60.0)
    assert held.value.holder == "host-a:1" and 50 < held.value.expires_in <= 60
    assert 50 < bus.lease_left("master") <= 60 and bus.lease_left("w9") is None
    assert held.value.exit_code == 2 and "host-a:1" in str(held.value)
    bus.release(claim)  # an older claim of the same holder releases too
    assert bus.claim("master", "host-b:2", 0.0).holder == "host-b:2"  # free; and expires at once
    assert bus.lease_left("master") == 0.0
    assert bus.claim("master", "host-c:3", 30.0).holder == "host-c:3"  # expired: taken over
    bus.release(renewed)  # not the holder any more: nothing happens
    with pytest.raises(ClaimHeld):
        bus.claim("master", "host-b:2", 30.0)
    with pytest.raises(BusError, match="invalid lease name"):
        bus.claim("../x", "h", 1.0)


def test_a_junk_lease_counts_as_expired(
    make_bus: Callable[..., S3Bus], server: S3Server, bucket: str
) -> None:
    bus = make_bus()
    server.admin().put_object(Bucket=bucket, Key="run/leases/w1.json", Body=b"{not json")
    assert bus.claim("w1", "me", 10.0).holder == "me"


def test_two_claimers_of_a_free_lease_exactly_one_wins(make_bus: Callable[..., S3Bus]) -> None:
    one, two = make_bus(), make_bus()
    for i in range(6):
        results = race(
            lambda i=i: one.claim(f"n{i}", "one", 60.0), lambda i=i: two.claim(f"n{i}", "two", 60.0)
        )
        held = [r for r in results if isinstance(r, ClaimHeld)]
        won = [r for r in results if not isinstance(r, Exception)]
        assert len(won) == 1 and len(held) == 1, results
        assert held[0].holder == won[0].holder


def test_release_without_conditional_delete_rechecks_the_holder(make_bus: Callable[..., S3Bus]) -> None:
    bus = make_bus()

    def refuse_conditional_delete(params: Any, **_: Any) -> None:
        if "IfMatch" in params:
            raise ClientError(
                {
                    "Error": {"Code": "NotImplemented", "Message": "no"},
                    "ResponseMetadata": {"HTTPStatusCode": 501},
                },
                "DeleteObject",
            )

    bus.client.meta.events.register("provide-client-params.s3.DeleteObject", refuse_conditional_delete)
    claim = bus.claim("w1", "me", 60.0)
    bus.release(claim)
    assert bus.claim("w1", "you", 60.0).holder == "you"
    bus.release(claim)  # not ours now: left alone
    with pytest.raises(ClaimHeld):
        bus.claim("w1", "me", 60.0)


# -- access and errors ----------------------------------------------------------------------------
def test_add_collaborator_grants_nothing_and_says_so(make_bus: Callable[..., S3Bus]) -> None:
    out = make_bus().add_collaborator("alice", "alice", None)
    assert out["delta_repo"] is None and out["granted_read_access"] is None
    assert "no per-user grants" in out["warning"] and "deltas/alice/" in out["warning"]
    with pytest.raises(ConfigError, match="drop --delta-repo"):
        make_bus().add_collaborator("alice", "alice", "alice/deltas")


@pytest.fixture
def with_auth(server: S3Server) -> Iterator[S3Server]:
    yield server
    server.auth(False)


def test_permission_errors_name_the_prefix_and_never_the_secret(
    with_auth: S3Server,
    bucket: str,
    make_bus: Callable[..., S3Bus],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = with_auth
    make_bus().publish(b"g0", head_doc(0))
    readable = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
    reader_key, reader_secret = server.user(
        f"reader{bucket}",
        [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": readable}],
    )
    server.auth(True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", reader_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", reader_secret)
    messages: list[str] = []
    with caplog.at_level(logging.DEBUG):
        reader = make_bus()
        assert reader.read_head()["outer_step"] == 0  # may read
        with pytest.raises(PermissionDenied) as denied:
            reader.check_worker_access("w1")
        messages.append(str(denied.value))
        assert f"s3://{bucket}/run/deltas/w1/" in str(denied.value) and "s3:PutObject" in str(denied.value)
        with pytest.raises(PermissionDenied, match="s3:PutObject"):
            reader.put_delta("w1", "w1--00000000.safetensors", b"x")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", reader_secret[:-4] + "XXXX")
        with pytest.raises(PermissionDenied, match="SignatureDoesNotMatch") as wrong:
            make_bus().read_manifest()
        messages.append(str(wrong.value))
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODYKNOWSTHIS0")
        with pytest.raises(PermissionDenied, match="InvalidAccessKeyId") as unknown:
            make_bus().read_head()
        messages.append(str(unknown.value))
    text = "\n".join(messages) + caplog.text
    for secret in (reader_secret, reader_secret[:-4] + "XXXX", SECRET_KEY):
        assert secret not in text


def test_classify_maps_store_failures() -> None:
    def error(code: str, status: int, headers: dict[str, str] | None = None) -> ClientError:
        meta = {"HTTPStatusCode": status, "HTTPHeaders": headers or {}}
        return ClientError(
            {"Error": {"Code": code, "Message": f"{code} says {SECRET_KEY}"}, "ResponseMetadata": meta},
            "PutObject",
        )

    from speedtronic.secrets import remember_secret

    remember_secret(SECRET_KEY)
    slow = classify(
        error("SlowDown", 503, {"retry-after": "7"}), "s3://b/p: upload", "s3:PutObject", "s3://b/p/k", None
    )
    assert isinstance(slow, TransientBusError) and slow.retry_after == 7.0  # type: ignore[attr-defined]
    assert SECRET_KEY not in str(slow)
    for code, status, kind in [
        ("InternalError", 500, TransientBusError),
        ("ServiceUnavailable", 503, TransientBusError),
        ("", 429, TransientBusError),
        ("AccessDenied", 403, PermissionDenied),
        ("InvalidAccessKeyId", 403, PermissionDenied),
        ("SignatureDoesNotMatch", 403, PermissionDenied),
        ("NoSuchKey", 404, BusError),
        ("PreconditionFailed", 412, BusError),
        ("ConditionalRequestConflict", 409, BusError),
        ("NotImplemented", 501, BusError),
    ]:
        failure = classify(error(code, status), "s3://b/p: upload", "s3:PutObject", "s3://b/p/k", None)
        assert isinstance(failure, kind), (code, failure)
        assert SECRET_KEY not in str(failure)
        if kind is PermissionDenied:
            assert "s3:PutObject on s3://b/p/k" in str(failure)
        if status in (409, 412, 404, 501):
            assert not isinstance(failure, TransientBusError)
    timeout = classify(
        ReadTimeoutError(endpoint_url="http://x"), "s3://b/p: read", "s3:GetObject", "k", "http://x"
    )
    assert isinstance(timeout, TransientBusError)


def test_an_unreachable_store_is_a_transient_error_after_retries(bucket: str) -> None:
    bus = open_bus(f"s3://{bucket}/run", endpoint=f"http://127.0.0.1:{free_port()}", **FAST)
    with pytest.raises(TransientBusError, match=r"talking to http://127\.0\.0\.1"):
        bus.read_head()
