"""Tests for `data prepare` of real-world inputs: folders, globs, JSONL, Parquet, compressed files,
documents with EOS, validation by documents, de-duplication, bad records, workers, shards and resume.

All inputs are built from the embedded corpus (paragraphs of tinyshakespeare are the documents).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_tokenizers import make_hf_tokenizer
from speedtronic.engine.data import (
    TokenFile,
    TrainLoader,
    build_data,
    load_tokenizer,
    prepare_dataset,
    read_meta,
)
from speedtronic.engine.data.meta import token_files
from speedtronic.engine.data.prepare import PARTIAL_DIR, is_val_document
from speedtronic.engine.data.text import read_default_corpus_bytes

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """120 documents: the first paragraphs (speeches) of the embedded corpus, some with non-ASCII."""
    paragraphs = read_default_corpus_bytes().decode("utf-8").split("\n\n")[:118]
    return [*paragraphs, "naïve café — ünïcödé ✓", "日本語の文書"]


@pytest.fixture(scope="module")
def eos_tokenizer(tmp_path_factory: pytest.TempPathFactory, docs: list[str]) -> Path:
    """A small byte-level BPE with an EOS token, trained on the documents."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return make_hf_tokenizer(path, docs, vocab_size=400, special_tokens=(EOS,), split_newlines=False)


def write_jsonl(path: Path, docs: list[str], field: str = "text", opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}, ensure_ascii=False) + "\n")
    return path


def split_tokens(directory: Path) -> tuple[list[int], list[int], dict]:
    meta = read_meta(directory)
    out = []
    for split in ("train", "val"):
        out.append(
            [
                t
                for f, n in token_files(meta, directory, split)
                for t in TokenFile(f, meta["dtype"]).read(0, n).tolist()
            ]
        )
    return out[0], out[1], meta


def expected(docs: list[str], encode, sep: list[int], val_fraction: float) -> tuple[list[int], list[int]]:
    """The train and val token streams the document rule gives."""
    train: list[int] = []
    val: list[int] = []
    for i, d in enumerate(docs):
        (val if is_val_document(i, val_fraction) else train).extend([*encode(d), *sep])
    return train, val


def byte_encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


# -- inputs: every kind gives the same tokens as the documents joined by separators ---------------------


def test_jsonl_equals_text_joined_with_separators(tmp_path: Path, docs: list[str]) -> None:
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs)
    meta = prepare_dataset(jsonl, tmp_path / "j", val_fraction=0.0, separator="\x00", unit_bytes=4096)
    # The same documents as one text file with the separator written out, prepared with none added.
    txt = tmp_path / "docs.txt"
    txt.write_bytes("".join(d + "\x00" for d in docs).encode("utf-8"))
    prepare_dataset(txt, tmp_path / "t", val_fraction=0.0, separator="")
    j_train, j_val, _ = split_tokens(tmp_path / "j")
    t_train, _, _ = split_tokens(tmp_path / "t")
    assert j_train == t_train == list(txt.read_bytes()) and j_val == []
    assert meta["documents"] == {"train": len(docs), "val": 0} and meta["separator"]["ids"] == [0]
    assert j_train.count(0) == len(docs)  # a separator after every document


@pytest.mark.parametrize("kind", ["jsonl.gz", "jsonl.zst", "parquet", "json-array", "folder", "glob"])
def test_every_input_kind_gives_the_same_tokens(kind: str, tmp_path: Path, docs: list[str]) -> None:
    src = tmp_path / "in"
    src.mkdir()
    if kind == "jsonl.gz":
        write_jsonl(src / "a.jsonl.gz", docs[:50], opener=gzip.open)
        write_jsonl(src / "b.jsonl.gz", docs[50:], opener=gzip.open)
        spec: str = str(src)
    elif kind == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        (src / "all.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
        spec = str(src / "all.jsonl.zst")
    elif kind == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(
            pa.table({"id": list(range(len(docs))), "content": docs}), src / "d.parquet", row_group_size=17
        )
        assert pq.ParquetFile(src / "d.parquet").metadata.num_row_groups > 1
        spec = str(src / "d.parquet")
    elif kind == "json-array":
        (src / "d.json").write_text(json.dumps([{"text": d} for d in docs]), encoding="utf-8")
        spec = str(src / "d.json")
    else:  # one .txt per document, numbered so sorted order is document order
        (src / "sub").mkdir()
        for i, d in enumerate(docs):
            (src / ("sub" if i % 2 else "") / f"{i:04d}.txt").write_text(d, encoding="utf-8")
        spec = str(src) if kind == "folder" else str(src / "**" / "*.txt")
        docs = [docs[i] for i in sorted(range(len(docs)), key=lambda i: (i % 2, i))]  # root files first
    field = "content" if kind == "parquet" else "text"
    meta = prepare_dataset(spec, tmp_path / "out", val_fraction=0.1, separator="\x00", text_field=field)
    train, val, _ = split_tokens(tmp_path / "out")
    assert (train, val) == expected(docs, byte_encode, [0], 0.1)
    assert meta["documents"] == {"train": len(docs) - 12, "val": 12} and meta["val_split"] == "documents"


def test_hf_tokenizer_eos_workers_and_shards(tmp_path: Path, docs: list[str], eos_tokenizer: Path) -> None:
    tok = load_tokenizer(str(eos_tokenizer))
    assert tok.eos_id is not None
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs)
    common = dict(tokenizer=str(eos_tokenizer), val_fraction=0.25, unit_bytes=2048, shard_tokens=1500)
    one = prepare_dataset(jsonl, tmp_path / "w1", workers=1, **common)
    two = prepare_dataset(jsonl, tmp_path / "w2", workers=2, **common)
    assert one == two  # the number of workers never changes the output
    for name in ("w1", "w2"):
        train, val, _meta = split_tokens(tmp_path / name)
        assert (train, val) == expected(docs, tok.encode, [tok.eos_id], 0.25)
    assert len(one["shards"]["train"]) > 2 and one["separator"] == {"eos_id": tok.eos_id}
    # The index: each shard's document count is the number of EOS tokens (document ends) in it.
    for split in ("train", "val"):
        for shard in one["shards"][split]:
            ids = TokenFile(tmp_path / "w1" / shard["file"], "uint16").read(0, shard["tokens"]).tolist()
            assert ids.count(tok.eos_id) == shard["documents"]
            assert (tmp_path / "w1" / shard["file"]).read_bytes() == (
                tmp_path / "w2" / shard["file"]
            ).read_bytes()
    assert one["documents"] == {"train": 90, "val": 30}


def test_single_document_and_few_documents_val(tmp_path: Path, docs: list[str]) -> None:
    # One text file is one document: validation is its last tokens (as before shards).
    single = tmp_path / "one.txt"
    single.write_text("".join(docs), encoding="utf-8")
    meta = prepare_dataset(single, tmp_path / "one", val_fraction=0.1)
    assert meta["val_split"] == "tokens" and meta["val_tokens"] == int(single.stat().st_size * 0.1)
    # Three documents and 10%: the rule picks none, so the last document is validation, whole.
    few = write_jsonl(tmp_path / "few.jsonl", docs[:3])
    meta = prepare_dataset(few, tmp_path / "few", val_fraction=0.1, separator="\x00")
    train, val, _ = split_tokens(tmp_path / "few")
    assert val == [*byte_encode(docs[2]), 0] and train == [t for d in docs[:2] for t in [*byte_encode(d), 0]]
    assert meta["documents"] == {"train": 2, "val": 1}


def test_dedup_drops_exact_duplicates(tmp_path: Path, docs: list[str]) -> None:
    repeated = docs[:30] + docs[10:20] + docs[30:40] + docs[:5]
    write_jsonl(tmp_path / "a.jsonl", repeated)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.txt").write_text(docs[0], encoding="utf-8")  # a text file equal to a record
    meta = prepare_dataset(
        [tmp_path / "a.jsonl", tmp_path / "t"],
        tmp_path / "out",
        val_fraction=0.0,
        separator="\x00",
        dedup=True,
    )
    train, _, _ = split_tokens(tmp_path / "out")
    assert train == expected(docs[:40], byte_encode, [0], 0.0)[0]
    assert meta["duplicates_skipped"] == 16 and meta["documents"]["train"] == 40


# -- bad input ----------------------------------------------------------------------------------------


def write_bad_jsonl(path: Path, docs: list[str]) -> Path:
    lines = [json.dumps({"text": d}).encode() for d in docs[:8]]
    lines[2] = b'{"text": "unterminated'  # line 3: malformed JSON
    lines[4] = json.dumps({"body": docs[4]}).encode()  # line 5: no text field
    lines[6] = b'{"text": "caf\xe9"}'  # line 7: Latin-1, not UTF-8
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_records_are_fatal_with_file_and_line(run_cli, tmp_path: Path, docs: list[str]) -> None:
    bad = write_bad_jsonl(tmp_path / "bad.jsonl", docs)
    result = run_cli("data", "prepare", bad, "--out", tmp_path / "out", "--workers", "2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{bad}:3: malformed JSON" in result.stderr and "--skip-bad" in result.stderr
    assert not (tmp_path / "out" / "meta.json").exists() and not (tmp_path / "out" / PARTIAL_DIR).exists()
    skipped = run_cli("data", "prepare", bad, "--out", tmp_path / "out", "--skip-bad", "--json")
    assert skipped.returncode == 0, skipped.stderr
    meta = json.loads(skipped.stdout.strip().splitlines()[-1])
    assert meta["bad_records_skipped"] == 3 and meta["documents"]["train"] + meta["documents"]["val"] == 5
    assert [e.split(": ")[0] for e in meta["bad_examples"]] == [f"{bad}:3", f"{bad}:5", f"{bad}:7"]
    assert "'text' is missing (fields: body)" in meta["bad_examples"][1]
    assert "skipped 3 bad records" in skipped.stderr


def test_bad_files_are_reported(run_cli, tmp_path: Path, docs: list[str], eos_tokenizer: Path) -> None:
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp_path / "trunc.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:60])
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"good line\nstill good\ncaf\xe9 au lait\n")
    os.mkfifo(tmp_path / "pipe.txt")
    cases = [
        (["broken.parquet"], "broken.parquet: not a readable Parquet file"),
        (["trunc.jsonl.gz"], "trunc.jsonl.gz: cannot read"),
        (["latin.txt", "--tokenizer", str(eos_tokenizer)], "latin.txt:3: not valid UTF-8"),
        (["pipe.txt"], "pipe.txt is not a regular file"),
        (["missing/*.jsonl"], "matches no .txt, .jsonl"),
        (["data.jsonl", "--text-field", "body"], "data.jsonl:1: text field 'body' is missing"),
    ]
    write_jsonl(tmp_path / "data.jsonl", docs[:3])
    for args, message in cases:
        result = run_cli("data", "prepare", *args, "--out", tmp_path / "out", cwd=tmp_path)
        assert result.returncode == 1, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    # A non-UTF-8 line of a text file is skipped (and counted) with --skip-bad.
    result = run_cli(
        "data",
        "prepare",
        "latin.txt",
        "--tokenizer",
        eos_tokenizer,
        "--skip-bad",
        "--json",
        "--out",
        "o",
        cwd=tmp_path,
    )
    assert result.returncode == 0 and json.loads(result.stdout.splitlines()[-1])["bad_records_skipped"] == 1


def test_folder_reads_regular_files_only(tmp_path: Path, docs: list[str]) -> None:
    src, outside = tmp_path / "in", tmp_path / "outside"
    src.mkdir()
    outside.mkdir()
    (src / "a.txt").write_text(docs[0], encoding="utf-8")
    (src / ".hidden.txt").write_text("hidden", encoding="utf-8")
    (src / "notes.csv").write_text("not an input kind", encoding="utf-8")
    (outside / "b.txt").write_text(docs[1], encoding="utf-8")
    (src / "link").symlink_to(outside, target_is_directory=True)  # not followed out of the folder
    os.mkfifo(src / "fifo.txt")  # would block a reader forever
    meta = prepare_dataset(src, tmp_path / "out", val_fraction=0.0, separator="")
    train, _, _ = split_tokens(tmp_path / "out")
    assert train == byte_encode(docs[0]) and meta["source"]["files"] == 1


# -- shards, resume, loading --------------------------------------------------------------------------


def test_interrupted_prepare_resumes_to_identical_output(tmp_path: Path, docs: list[str]) -> None:
    jsonl = write_jsonl(tmp_path / "docs.jsonl", docs * 2)
    common = dict(val_fraction=0.1, unit_bytes=1024, shard_tokens=3000, dedup=True, checkpoint_units=3)
    whole = prepare_dataset(jsonl, tmp_path / "whole", **common)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(jsonl, tmp_path / "cut", stop_after_units=10, **common)
    assert (
        not (tmp_path / "cut" / "meta.json").exists()
        and (tmp_path / "cut" / PARTIAL_DIR / "state.json").exists()
    )
    resumed = prepare_dataset(jsonl, tmp_path / "cut", workers=2, **common)
    assert resumed["resumed_units"] == 9  # the last checkpoint, 3 units at a time
    assert {**resumed, "resumed_units": 0} == whole and resumed["duplicates_skipped"] == len(docs)
    names = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "cut").iterdir()) and len(names) > 4
    for name in names:
        if name == "meta.json":
            continue  # equal but for resumed_units, compared above
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "cut" / name).read_bytes()
    # --restart (resume=False) or other options start over instead of mixing runs.
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(jsonl, tmp_path / "cut2", stop_after_units=4, **common)
    again = prepare_dataset(jsonl, tmp_path / "cut2", **{**common, "val_fraction": 0.2})
    assert again["resumed_units"] == 0


def test_sharded_dataset_trains_like_one_file_and_resumes_across_world_sizes(
    tmp_path: Path, docs: list[str]
) -> None:
    jsonl = write_jsonl(tmp_path / "d.jsonl", docs[:60])
    prepare_dataset(jsonl, tmp_path / "one", separator="\n")
    meta = prepare_dataset(jsonl, tmp_path / "many", separator="\n", shard_tokens=997, unit_bytes=512)
    assert len(meta["shards"]["train"]) > 5

    def loader(name: str, rank: int = 0, world: int = 1) -> TrainLoader:
        c = SimpleNamespace(dataset=str(tmp_path / name), block_size=64, micro_batch_size=4, seed=3)
        return build_data(c, rank=rank, world_size=world).train

    a, b = loader("one"), loader("many")
    for _ in range(12):
        x, y = next(a), next(b)
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    # Two ranks serve 3 batches each; one rank resumes at global batch 6.
    ranks = [loader("many", r, 2) for r in range(2)]
    for r in ranks:
        for _ in range(3):
            next(r)
    solo, reference = loader("many"), loader("one")
    solo.load_state_dict(ranks[0].state_dict())
    for _ in range(6):
        next(reference)
    assert torch.equal(next(solo)["input_ids"], next(reference)["input_ids"])


def test_format_1_datasets_still_load(tmp_path: Path) -> None:
    d = tmp_path / "v1"
    d.mkdir()
    tokens = torch.arange(300, dtype=torch.int64) % 256
    (d / "train.bin").write_bytes(tokens[:270].to(torch.uint16).numpy().tobytes())
    (d / "val.bin").write_bytes(tokens[270:].to(torch.uint16).numpy().tobytes())
    meta = {
        "format": "speedtronic-tokens",
        "version": 1,
        "dtype": "uint16",
        "vocab_size": 256,
        "tokenizer": "byte",
        "train_tokens": 270,
        "val_tokens": 30,
    }
    (d / "meta.json").write_text(json.dumps(meta))
    bundle = build_data(SimpleNamespace(dataset=str(d), block_size=8, micro_batch_size=2, shuffle=False))
    assert next(bundle.train)["input_ids"][0].tolist() == list(range(8))
    assert bundle.val_batches()[0]["input_ids"][0].tolist() == [t % 256 for t in range(270, 278)]
