"""Tests for ``prepare_dataset`` and the prepared-directory reader (meta.json validation)."""

from __future__ import annotations

import io
import itertools
import json
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_tokenizers import make_hf_tokenizer
from speedtronic.engine.data import (
    ByteTokenizer,
    TokenFile,
    build_data,
    dtype_for_vocab,
    load_tokenizer,
    prepare_dataset,
    read_meta,
    tokenize_file,
)
from speedtronic.engine.data.meta import token_files
from speedtronic.engine.data.prepare import PARTIAL_DIR
from speedtronic.engine.data.text import iter_chunks
from speedtronic.errors import ConfigError, DataError

WORDS = ["alpha", "beta", "gamma", "delta", "héllo", "wörld", "日本", "👋", "to", "be", "or", "not"]


def make_text(num_lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return (
        "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(num_lines))
        + "\n"
    )


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def read_tokens(directory: Path) -> tuple[list[int], list[int], dict]:
    meta = read_meta(directory)
    splits = [
        [
            t
            for f, _ in token_files(meta, directory, split)
            for t in TokenFile(f, meta["dtype"]).read(0, _).tolist()
        ]
        for split in ("train", "val")
    ]
    return splits[0], splits[1], meta


class BigVocabTokenizer:
    """A tokenizer with a vocabulary beyond uint16: one id per character, offset past 65,535."""

    vocab_size = 70_000
    eos_id = None
    spec = "test-big-vocab"

    def encode(self, text: str) -> list[int]:
        return [65_536 + (ord(c) % 4000) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i - 65_536) for i in ids)

    def describe(self) -> str:
        return "big-vocab test tokenizer"


# -- prepare round trips ---------------------------------------------------------------------------


def test_prepare_byte_round_trip(tmp_path: Path) -> None:
    text = make_text(500)
    src = write(tmp_path / "book.txt", text)
    calls: list[tuple[int, int]] = []
    meta = prepare_dataset(
        src,
        tmp_path / "out",
        val_fraction=0.2,
        progress=lambda d, t: calls.append((d, t)),
        chunk_bytes=256,
        unit_bytes=256,
    )
    raw = list(text.encode("utf-8"))
    train, val, on_disk = read_tokens(tmp_path / "out")
    assert train + val == raw  # exactly the bytes of the file, in order
    assert len(val) == int(len(raw) * 0.2) and meta == on_disk
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 256 and meta["tokenizer"] == "byte"
    assert meta["source"] == {"name": "book.txt", "bytes": len(raw), "files": 1, "kinds": {"text": 1}}
    assert meta["train_tokens"] == len(train) and meta["version"] == 2 and meta["val_split"] == "tokens"
    assert (tmp_path / "out" / "train-00000.bin").stat().st_size == 2 * len(train)
    # Progress: once per unit of 256 bytes, monotonic, ending at (total, total).
    assert len(calls) >= len(raw) // 512 and calls[-1] == (len(raw), len(raw))
    assert all(a[0] < b[0] for a, b in itertools.pairwise(calls)) and {t for _, t in calls} == {len(raw)}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "meta.json",
        "train-00000.bin",
        "val-00000.bin",
    ]


def test_prepare_hf_equals_direct_tokenisation(tmp_path: Path) -> None:
    text = make_text(300, seed=1)
    src = write(tmp_path / "t.txt", text)
    tok_path = make_hf_tokenizer(
        tmp_path / "tokenizer.json", make_text(200, seed=2), vocab_size=300, special_tokens=()
    )
    tok = load_tokenizer(str(tok_path))
    meta = prepare_dataset(src, tmp_path / "out", tokenizer=str(tok_path), val_fraction=0.1, chunk_bytes=128)
    train, val, _ = read_tokens(tmp_path / "out")
    assert train + val == tok.encode(text)  # chunked at newlines, same tokens as one encode() call
    assert train + val == tokenize_file(src, tok, chunk_bytes=128).tokens.tolist()
    assert meta["tokenizer"] == str(tok_path.resolve()) and meta["vocab_size"] == tok.vocab_size
    assert tok.decode(train + val) == text
    # A prepared directory remembers its tokenizer: build_data needs no tokenizer setting.
    c = SimpleNamespace(dataset=str(tmp_path / "out"), block_size=8, micro_batch_size=2, val_fraction=0.1)
    bundle = build_data(c)
    assert bundle.tokenizer.spec == meta["tokenizer"] and bundle.vocab_size == tok.vocab_size
    assert len(bundle.val_batches()) > 0


def test_dtype_choice_uint16_vs_uint32(tmp_path: Path) -> None:
    assert dtype_for_vocab(256) == dtype_for_vocab(65_535) == "uint16"
    assert dtype_for_vocab(65_536) == dtype_for_vocab(200_000) == "uint32"
    with pytest.raises(ValueError):
        dtype_for_vocab(0)
    text = "wide ids ✓\n" * 20
    src = write(tmp_path / "w.txt", text)
    meta = prepare_dataset(src, tmp_path / "out", tokenizer=BigVocabTokenizer(), val_fraction=0.25)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    train, val, _ = read_tokens(tmp_path / "out")
    assert train + val == BigVocabTokenizer().encode(text)
    assert min(train) > 65_535  # survived the round trip without truncation to 16 bits
    assert (tmp_path / "out" / "val-00000.bin").stat().st_size == 4 * len(val)


def test_prepare_replaces_existing_dataset_and_leaves_no_temp_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(write(tmp_path / "a.txt", "first version\n" * 10), out)
    prepare_dataset(write(tmp_path / "b.txt", "second\n" * 30), out, val_fraction=0.0, overwrite=True)
    train, val, meta = read_tokens(out)
    assert bytes(train) == b"second\n" * 30 and val == [] and meta["source"]["name"] == "b.txt"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train-00000.bin"]


def test_failed_prepare_keeps_previous_dataset(tmp_path: Path) -> None:
    out = tmp_path / "out"
    prepare_dataset(write(tmp_path / "a.txt", "good data\n" * 10), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok line\n" * 50 + b"\xff\xfe broken utf-8\n")
    tok_path = make_hf_tokenizer(tmp_path / "tok.json", make_text(50), vocab_size=300, special_tokens=())
    with pytest.raises(DataError, match=r"bad\.txt.*not valid UTF-8"):
        prepare_dataset(bad, out, tokenizer=str(tok_path), chunk_bytes=64, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # untouched, no temp files
    # The byte tokenizer takes any bytes.
    prepare_dataset(bad, tmp_path / "bytes")
    train, val, _ = read_tokens(tmp_path / "bytes")
    assert bytes(train + val) == bad.read_bytes()


def test_prepare_missing_source_is_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing\.txt"):
        prepare_dataset(tmp_path / "missing.txt", tmp_path / "out")
    with pytest.raises(ValueError):
        prepare_dataset(write(tmp_path / "x.txt", "x\n"), tmp_path / "out", val_fraction=1.0)


# -- reading prepared directories -----------------------------------------------------------------


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    prepare_dataset(write(tmp_path / "src.txt", make_text(100)), tmp_path / "ds")
    return tmp_path / "ds"


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: (d / "meta.json").unlink(), r"meta\.json is missing"),
        (lambda d: (d / "meta.json").write_text("{not json"), r"meta\.json is unreadable or corrupt"),
        (lambda d: (d / "meta.json").write_text("[1, 2]"), r"meta\.json is corrupt"),
        (lambda d: _edit_meta(d, dtype="float32"), "unknown dtype"),
        (lambda d: _edit_meta(d, train_tokens="many"), "train_tokens"),
        (lambda d: _edit_meta(d, version=99), "newer than this speedtronic"),
        (lambda d: _edit_meta(d, format="something-else"), "not a speedtronic dataset"),
        (lambda d: (d / "train-00000.bin").write_bytes(b"\x00" * 10), r"train-00000\.bin is 10 bytes"),
        (lambda d: (d / "val-00000.bin").unlink(), r"val-00000\.bin is missing"),
        (
            lambda d: _edit_meta(d, shards={"train": [{"file": "../x.bin", "tokens": 1}], "val": []}),
            "shard entry",
        ),
    ],
)
def test_corrupt_dataset_dir_is_data_error(prepared: Path, damage, match: str) -> None:
    damage(prepared)
    with pytest.raises(DataError, match=match) as info:
        read_meta(prepared)
    assert "speedtronic data prepare" in str(info.value) or "upgrade" in str(info.value)
    assert str(prepared) in str(info.value)
    with pytest.raises(DataError):
        build_data(SimpleNamespace(dataset=str(prepared), block_size=8, micro_batch_size=2))


def _edit_meta(d: Path, **changes: object) -> None:
    meta = json.loads((d / "meta.json").read_text())
    meta.update(changes)
    (d / "meta.json").write_text(json.dumps(meta))


def test_missing_dataset_dir_and_odd_token_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="speedtronic data prepare"):
        read_meta(tmp_path / "nope")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(DataError, match="not a multiple of 2"):
        TokenFile(odd, "uint16")


def test_dataset_tokenizer_mismatch_is_data_error(prepared: Path, tmp_path: Path) -> None:
    tok_path = make_hf_tokenizer(tmp_path / "tok.json", make_text(50), vocab_size=300, special_tokens=())
    c = SimpleNamespace(dataset=str(prepared), tokenizer=str(tok_path), block_size=8, micro_batch_size=2)
    with pytest.raises(DataError, match="vocab"):
        build_data(c)


# -- properties ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(max_size=300),
    val_fraction=st.sampled_from([0.0, 0.1, 0.5, 0.9]),
    chunk_bytes=st.integers(min_value=4, max_value=64),
)
def test_prepare_and_byte_tokenizer_round_trip_random_text(
    text: str, val_fraction: float, chunk_bytes: int
) -> None:
    text = text.replace("\r", "")  # the file is written verbatim; keep the comparison newline-agnostic
    with tempfile.TemporaryDirectory() as d:
        src = write(Path(d) / "t.txt", text)
        meta = prepare_dataset(src, Path(d) / "out", val_fraction=val_fraction, chunk_bytes=chunk_bytes)
        train, val, _ = read_tokens(Path(d) / "out")
    tok = ByteTokenizer()
    assert train + val == tok.encode(text)
    assert tok.decode(train + val) == text
    n = len(text.encode("utf-8"))
    assert meta["val_tokens"] == int(n * val_fraction) and meta["train_tokens"] == n - meta["val_tokens"]


@settings(max_examples=150, deadline=None, database=None)
@given(text=st.text(max_size=200), chunk_bytes=st.integers(min_value=4, max_value=40))
def test_chunks_tile_the_file_and_split_at_character_boundaries(text: str, chunk_bytes: int) -> None:
    data = text.encode("utf-8")
    chunks = list(iter_chunks(io.BytesIO(data), 0, len(data), chunk_bytes))
    assert b"".join(c for _, c in chunks) == data
    pos = 0
    for offset, chunk in chunks:
        assert offset == pos and 0 < len(chunk) <= chunk_bytes
        chunk.decode("utf-8")  # never cuts a character in two
        pos += len(chunk)
    # Memoryless: restarting at any chunk offset reproduces the remaining chunks exactly.
    for i, (offset, _) in enumerate(chunks):
        assert list(iter_chunks(io.BytesIO(data), offset, len(data), chunk_bytes)) == chunks[i:]


def test_prepare_refuses_a_non_empty_output_without_overwrite(tmp_path: Path, run_cli) -> None:
    out = tmp_path / "out"
    prepare_dataset(write(tmp_path / "a.txt", "first version\n" * 10), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConfigError, match=r"already holds a prepared dataset; pass --overwrite") as info:
        prepare_dataset(write(tmp_path / "b.txt", "second\n" * 30), out)
    assert info.value.exit_code == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me", encoding="utf-8")
    refused = run_cli("data", "prepare", "b.txt", "--out", "notes")
    assert refused.returncode == 2 and "--overwrite" in refused.stderr, refused.stderr
    replaced = run_cli("data", "prepare", "b.txt", "--out", "out", "--overwrite", "--json")
    assert replaced.returncode == 0, replaced.stderr
    _, _, meta = read_tokens(out)
    assert meta["source"]["name"] == "b.txt"


def test_an_interrupted_prepare_resumes_without_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    source = write(tmp_path / "a.txt", "line of text\n" * 400)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(source, out, unit_bytes=512, checkpoint_units=1, stop_after_units=2)
    assert [p.name for p in out.iterdir()] == [PARTIAL_DIR]
    meta = prepare_dataset(source, out, unit_bytes=512, checkpoint_units=1)
    train, val, _ = read_tokens(out)
    assert bytes(train + val) == source.read_bytes() and meta["train_tokens"] + meta["val_tokens"] > 0
