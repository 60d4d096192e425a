"""`data prepare hf://datasets/...`: a small dataset repo (Parquet and JSONL shards) served by the loopback
Hub (tests/hub_server.py) and read by the real huggingface_hub client. The tokens equal a local prepare of
the same files; --text-field, --max-tokens, resume without re-downloading, bad repos and the token."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import speedtronic
from hub_server import HubServer
from speedtronic.engine.data import prepare_dataset
from speedtronic.engine.data.hub import hub_dataset_dir, is_hub_dataset, parse_hub_uri, prepare_hub_dataset
from speedtronic.engine.data.text import read_default_corpus_bytes
from speedtronic.errors import BusError, ConfigError
from speedtronic.hub_client import HubClient

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

TOKEN = "hf_loopbackdatasettoken0001"
URI = "hf://datasets/me/corpus/data"


def _parquet(docs: list[str], row_group: int) -> bytes:
    table = pa.table({"id": list(range(len(docs))), "text": docs, "url": ["u"] * len(docs)})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group)
    return sink.getvalue().to_pybytes()


def _jsonl(docs: list[str]) -> bytes:
    return "".join(
        json.dumps({"text": d, "n": i}, ensure_ascii=False) + "\n" for i, d in enumerate(docs)
    ).encode()


def _files() -> dict[str, bytes]:
    """The repo: two Parquet shards (two row groups each), two JSONL shards (one below a sub-folder, so the
    walk order matters) and dataset cards (README.md), which are not data."""
    docs = [p for p in read_default_corpus_bytes().decode("utf-8").split("\n\n")[:80] if p.strip()]
    docs += ["naïve café — ünïcödé ✓", "日本語の文書"]
    return {
        "README.md": b"# corpus\n",
        "data/README.md": b"# the card of the data folder: not data\n",
        "data/part-000.parquet": _parquet(docs[0:20], row_group=10),
        "data/part-001.parquet": _parquet(docs[20:40], row_group=10),
        "data/part-002.jsonl": _jsonl(docs[40:60]),
        "data/extra/more.jsonl": _jsonl(docs[60:]),
    }


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> HubServer:
    """A loopback Hub with the dataset repo me/corpus (private: only the token reads it), and the same
    files in tmp_path/local for a local prepare."""
    from huggingface_hub import CommitOperationAdd, HfApi

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    server = HubServer()
    server.state.add_user("me", TOKEN)
    api = HfApi(endpoint=server.url, token=TOKEN)
    api.create_repo("me/corpus", repo_type="dataset", private=True)
    files = _files()
    ops = [CommitOperationAdd(path, data) for path, data in files.items()]
    api.create_commit("me/corpus", ops, commit_message="data", repo_type="dataset")
    for path, data in files.items():
        if path.endswith(".md"):  # the dataset cards are not data: the local copy holds the data files
            continue
        local = tmp_path / "local" / path
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
    yield server
    server.stop()


def _tokens(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.bin"))}


def _gets(server: HubServer) -> list[str]:
    """The files the server sent (GET of resolve), in order."""
    return [
        path.split("/resolve/")[1].split("/", 1)[1]
        for m, path in server.state.requests
        if m == "GET" and "/resolve/" in path
    ]


def test_the_uri_is_parsed_and_hub_inputs_are_told_apart() -> None:
    ds = parse_hub_uri("hf://datasets/HuggingFaceFW/fineweb-edu@v1.2/sample/10BT")
    assert (ds.repo_id, ds.revision, ds.path) == ("HuggingFaceFW/fineweb-edu", "v1.2", "sample/10BT")
    assert parse_hub_uri("hf://datasets/me/corpus").uri == "hf://datasets/me/corpus"
    assert is_hub_dataset("hf://datasets/me/corpus") and not is_hub_dataset("data/corpus")
    for bad in ("hf://models/me/m", "hf://datasets/me", "hf://datasets/me/c/../x"):
        with pytest.raises(ConfigError):
            parse_hub_uri(bad)


def test_cli_tokens_equal_a_local_prepare_and_the_token_never_shows(
    hub: HubServer, tmp_path: Path, run_cli
) -> None:
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1"}
    got = run_cli("data", "prepare", URI, "--out", "from_hub", "--separator", "\n\n", "--json", env=env)
    assert got.returncode == 0, got.stderr
    local = run_cli("data", "prepare", "local/data", "--out", "from_disk", "--separator", "\n\n", "--json")
    assert local.returncode == 0, local.stderr
    assert _tokens(tmp_path / "from_hub") == _tokens(tmp_path / "from_disk") != {}
    meta = json.loads(got.stdout)
    assert meta["train_tokens"] == json.loads(local.stdout)["train_tokens"] > 0
    assert meta["source"]["name"] == URI and meta["source"]["files"] == meta["source"]["files_listed"] == 4
    assert _gets(hub) == [
        "data/part-000.parquet",
        "data/part-001.parquet",
        "data/part-002.jsonl",
        "data/extra/more.jsonl",
    ]
    # A bad --text-field: one line listing the columns, exit 2.
    bad = run_cli("data", "prepare", URI, "--out", "other", "--text-field", "body", env=env)
    assert bad.returncode == 2, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "--text-field 'body'" in bad.stderr and "id, text, url" in bad.stderr
    # The token appears nowhere: output, errors, the prepared files.
    written = b"".join(
        p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "hf_home" not in p.parts
    )
    for text in (got.stdout, got.stderr, bad.stdout, bad.stderr):
        assert TOKEN not in text
    assert TOKEN.encode() not in written


def test_bad_addresses_fail_in_one_line(hub: HubServer, run_cli) -> None:
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    cases = {
        "hf://datasets/me/nope": "no such dataset",
        "hf://datasets/me/corpus@v9": "revision 'v9' not found",
        "hf://datasets/me/corpus/nothere": "no file or folder 'nothere'",
        "hf://models/me/corpus": "only dataset repos",
    }
    for uri, words in cases.items():
        result = run_cli("data", "prepare", uri, "--out", "out", env=env)
        assert result.returncode == 2 and words in result.stderr, (uri, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and TOKEN not in result.stderr, result.stderr
    mixed = run_cli("data", "prepare", URI, "local/data", "--out", "out", env=env)
    assert mixed.returncode == 2 and "must be the only input" in mixed.stderr, mixed.stderr
    # Without the token the private repo reads as missing, like on the Hub.
    anonymous = run_cli("data", "prepare", URI, "--out", "out", env={"HF_ENDPOINT": hub.url})
    assert anonymous.returncode == 2 and "no such dataset" in anonymous.stderr, anonymous.stderr


def test_max_tokens_stops_there_and_reads_no_more_files_than_it_needs(hub: HubServer, tmp_path: Path) -> None:
    options = {"separator": "\n\n", "val_fraction": 0.5}  # every other document is validation
    full = prepare_dataset(tmp_path / "local" / "data", tmp_path / "full", **options)
    capped = prepare_hub_dataset(
        URI,
        tmp_path / "capped",
        endpoint=hub.url,
        token=TOKEN,
        cache_dir=str(tmp_path / "cache"),
        max_tokens=1000,
        **options,
    )
    assert capped["train_tokens"] + capped["val_tokens"] == 1000 < full["train_tokens"]
    assert capped["source"]["files"] == 1 and capped["max_tokens"] == 1000
    # What it keeps is where the full run starts: each split a prefix of the full one's.
    whole, kept = _tokens(tmp_path / "full"), _tokens(tmp_path / "capped")
    for split in ("train-00000.bin", "val-00000.bin"):
        assert len(kept[split]) > 0 and whole[split].startswith(kept[split])
    assert _gets(hub) == ["data/part-000.parquet"]  # under a cap, no file is fetched ahead
    # The cap is the same for local inputs, also from a pool of workers.
    local = prepare_dataset(
        tmp_path / "local" / "data", tmp_path / "local-capped", max_tokens=1000, workers=2, **options
    )
    assert _tokens(tmp_path / "local-capped") == kept and local["documents"] == capped["documents"]


def test_an_interrupted_prepare_resumes_without_downloading_finished_files(
    hub: HubServer, tmp_path: Path
) -> None:
    args = {
        "endpoint": hub.url,
        "token": TOKEN,
        "cache_dir": str(tmp_path / "cache"),
        "separator": "\n\n",
        "unit_bytes": 2048,
        "checkpoint_units": 1,
    }
    with pytest.raises(KeyboardInterrupt):  # after part-000's two row groups and one of part-001's
        prepare_hub_dataset(URI, tmp_path / "out", stop_after_units=3, **args)
    assert not (tmp_path / "out" / "meta.json").exists()
    for thread in threading.enumerate():  # the next file was being fetched ahead: let it land first
        if thread.name.startswith("hub-download"):
            thread.join()
    shutil.rmtree(tmp_path / "cache")  # even with the cache gone, a finished file is not fetched again
    hub.state.requests.clear()
    meta = prepare_hub_dataset(URI, tmp_path / "out", **args)
    assert meta["resumed_units"] == 3 and meta["source"]["files"] == 4
    assert _gets(hub) == ["data/part-001.parquet", "data/part-002.jsonl", "data/extra/more.jsonl"]
    whole = prepare_dataset(
        tmp_path / "local" / "data", tmp_path / "whole", separator="\n\n", unit_bytes=2048
    )
    assert (
        _tokens(tmp_path / "out") == _tokens(tmp_path / "whole") and meta["documents"] == whole["documents"]
    )


@pytest.mark.slow
def test_a_killed_prepare_resumes_without_downloading_finished_files(
    hub: HubServer, tmp_path: Path, run_cli
) -> None:
    """A real `data prepare` process killed with SIGKILL while it waits for the third file (its
    download hangs): the next run fetches neither of the two files it had finished, even with the
    Hugging Face cache emptied, and writes the tokens an uninterrupted local prepare writes."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_XET": "1"}
    env["HF_HOME"] = str(tmp_path / "hf_home")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(speedtronic.__file__).parents[1]), env.get("PYTHONPATH")])
    )
    hub.hang_next(1, 30.0, match="part-002.jsonl")
    command = [sys.executable, "-m", "speedtronic", "data", "prepare", URI, "--out", "out", "--workers", "1"]
    child = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    state = tmp_path / "out" / ".prepare-partial" / "state.json"
    try:
        for _ in range(600):  # until both Parquet files (two row groups each) are done and saved
            if state.exists() and json.loads(state.read_text() or "{}").get("units_done") == 4:
                break
            assert child.poll() is None, "the prepare ended before it was killed"
            time.sleep(0.1)
        else:
            pytest.fail("the prepare never finished its first two files")
    finally:
        child.kill()
        child.wait()
    shutil.rmtree(tmp_path / "hf_home" / "hub")
    hub.state.requests.clear()
    resumed = run_cli(
        "data",
        "prepare",
        URI,
        "--out",
        "out",
        "--json",
        env={k: env[k] for k in ("HF_ENDPOINT", "HF_TOKEN", "HF_HUB_DISABLE_XET")},
    )
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["resumed_units"] == 4
    assert _gets(hub) == ["data/part-002.jsonl", "data/extra/more.jsonl"]
    assert run_cli("data", "prepare", "local/data", "--out", "whole").returncode == 0
    assert _tokens(tmp_path / "out") == _tokens(tmp_path / "whole")


def test_a_hub_that_fails_midway_stops_in_one_line_and_the_next_run_resumes(
    hub: HubServer, tmp_path: Path
) -> None:
    client = HubClient(endpoint=hub.url, token=TOKEN, retry_initial=0.01, retry_max=0.02, retry_attempts=2)
    args = {"client": client, "cache_dir": str(tmp_path / "cache"), "separator": "\n\n", "workers": 1}
    # The file's download fails for good (huggingface_hub retries a 5xx itself for a minute: a 404 it
    # does not, and it stands for any failure the retries could not mend).
    sha = hub.state.repos["datasets/me/corpus"].head[0]
    hub.fail_next(100, 404, match=f"GET /datasets/me/corpus/resolve/{sha}/data/part-002.jsonl")
    with pytest.raises(BusError, match=r"download data/part-002.jsonl.*the same command resumes") as failed:
        prepare_hub_dataset(URI, tmp_path / "out", **args)
    assert "\n" not in str(failed.value) and TOKEN not in str(failed.value)
    assert (tmp_path / "out" / ".prepare-partial" / "state.json").exists()
    hub.clear_faults()
    meta = prepare_hub_dataset(URI, tmp_path / "out", **args)
    assert meta["resumed_units"] == 4  # both Parquet files were done
    prepare_dataset(tmp_path / "local" / "data", tmp_path / "whole", separator="\n\n")
    assert _tokens(tmp_path / "out") == _tokens(tmp_path / "whole")


def test_a_revision_pins_the_commit_read(hub: HubServer, tmp_path: Path) -> None:
    from huggingface_hub import CommitOperationDelete, HfApi

    old = hub.state.repos["datasets/me/corpus"].head[0]
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_commit(
        "me/corpus", [CommitOperationDelete("data/extra/")], commit_message="drop", repo_type="dataset"
    )
    args = {"endpoint": hub.url, "token": TOKEN, "cache_dir": str(tmp_path / "cache"), "separator": "\n\n"}
    pinned = prepare_hub_dataset(f"hf://datasets/me/corpus@{old}/data", tmp_path / "pinned", **args)
    head = prepare_hub_dataset(URI, tmp_path / "head", **args)
    assert pinned["source"]["revision"] == old and pinned["source"]["files"] == 4
    assert head["source"]["revision"] != old and head["source"]["files"] == 3
    prepare_dataset(tmp_path / "local" / "data", tmp_path / "whole", separator="\n\n")
    assert _tokens(tmp_path / "pinned") == _tokens(tmp_path / "whole") != _tokens(tmp_path / "head")


def test_a_config_entry_gets_its_prepared_folder_once(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    first = hub_dataset_dir(URI, tmp_path / "prepared", separator="\n\n")
    assert first.parent == tmp_path / "prepared" and first.name.startswith("me--corpus-data-")
    capped = hub_dataset_dir(URI, tmp_path / "prepared", separator="\n\n", max_tokens=500)
    assert capped != first and json.loads((capped / "meta.json").read_text())["train_tokens"] < 500
    hub.stop()  # a finished folder is found without the network
    assert hub_dataset_dir(URI, tmp_path / "prepared", separator="\n\n") == first
    prepare_dataset(tmp_path / "local" / "data", tmp_path / "whole", separator="\n\n")
    assert _tokens(first) == _tokens(tmp_path / "whole")


def test_a_mixture_entry_names_a_hub_dataset(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`data.sources: [{path: hf://datasets/...}]` beside a local file: prepared once into the data cache,
    then opened as a dataset with the same tokens as a local prepare; a second build uses no network."""
    from speedtronic.config import load_config
    from speedtronic.engine.data import build_data

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("SPEEDTRONIC_DATA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "books.txt").write_text("once upon a time " * 400)
    entries = f"[{{path: '{URI}', name: hub}}, {{path: {tmp_path / 'books.txt'}}}]"
    cfg = load_config(None, [f"data.sources={entries}", "data.block_size=16", "data.micro_batch_size=4"]).data
    bundle = build_data(cfg)
    assert set(bundle.val_by_source) == {"hub", "books"}
    (prepared,) = (tmp_path / "cache" / "hub").glob("me--corpus-data-*")
    hub.stop()  # prepared once: the next run reads the cache
    again = build_data(cfg)
    assert set(again.val_by_source) == {"hub", "books"}
    assert json.loads((prepared / "meta.json").read_text())["train_tokens"] > 0
