"""Tests for the data layer: tokenizers, token sources, the resumable loader, streaming and build_data."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hf_tokenizers import make_hf_tokenizer
from speedtronic.engine.data import (
    ByteFileSource,
    ByteTokenizer,
    DataBundle,
    HFTokenizer,
    SyntheticTokens,
    TextStream,
    TokenArray,
    TrainLoader,
    build_data,
    load_tokenizer,
    make_val_batches,
    prepare_dataset,
    read_default_corpus,
    split_train_val,
    tokenize_file,
)
from speedtronic.engine.data import sources as sources_mod
from speedtronic.errors import ConfigError, DataError

SHAKESPEARE = Path("/work/shared/data/tinyshakespeare.txt")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "héllo",
    "wörld",
    "naïve",
    "café",
    "日本",
    "語",
    "👋",
    "to",
    "be",
    "or",
    "not",
]


# -- helpers ---------------------------------------------------------------------------------------


def make_text(num_lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(num_lines))
    return "\n".join(lines) + "\n"


def write(tmp_path: Path, text: str, name: str = "corpus.txt") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode("utf-8"))
    return p


def cfg(**overrides: Any) -> SimpleNamespace:
    base: dict[str, Any] = dict(
        text_path=None,
        dataset=None,
        synthetic=False,
        num_tokens=4096,
        vocab_size=None,
        block_size=16,
        micro_batch_size=4,
        num_workers=0,
        prefetch_factor=None,
        pin_memory=False,
        shuffle=True,
        drop_last=True,
        seed=1234,
        tokenizer=None,
        val_fraction=0.1,
        val_batches=3,
    )
    base.update(overrides)
    return SimpleNamespace(**base)


def take(loader: TrainLoader, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(loader) for _ in range(n)]


def assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.keys() == y.keys() == {"input_ids", "labels"}
        for k in x:
            assert torch.equal(x[k], y[k]), f"batch {i} {k} differs"


def arange_source(n: int) -> TokenArray:
    # Token value == position, so every batch tells exactly which positions it came from.
    return TokenArray(torch.arange(n, dtype=torch.int32), name="arange")


# -- tokenizers ------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_unicode() -> None:
    tok = ByteTokenizer()
    text = "Hello, wörld! 日本語 👋\n\ttabs & ünïcödé"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(isinstance(i, int) and 0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256 and tok.eos_id is None and tok.spec == "byte"
    # A cut in the middle of a multi-byte character, or an id outside the byte range, decodes to U+FFFD.
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"
    assert tok.decode([104, 300, 105]) == "h\ufffdi"
    assert ByteTokenizer(eos_id=0).eos_id == 0
    with pytest.raises(ValueError):
        ByteTokenizer(eos_id=256)


def test_load_tokenizer_byte_specs() -> None:
    for spec in (None, "byte", "BYTE", ""):
        assert isinstance(load_tokenizer(spec), ByteTokenizer)


def test_hf_tokenizer_round_trip(tmp_path: Path) -> None:
    corpus = make_text(200)
    path = make_hf_tokenizer(tmp_path / "tokenizer.json", corpus)
    for spec in (str(path), str(tmp_path)):  # the file, or the directory holding tokenizer.json
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        text = "the lazy dog  héllo 👋\n\nto be\n"
        ids = tok.encode(text)
        assert len(ids) < len(text.encode())  # merges happened: it is really BPE, not bytes
        assert tok.decode(ids) == text
        assert 256 < tok.vocab_size <= 320 and max(ids) < tok.vocab_size
        assert tok.eos_id is not None and tok.decode([tok.eos_id]) == "<|endoftext|>"
        assert tok.spec == str(path.resolve())
        assert "tokenizer.json" in tok.describe()


def test_hf_tokenizer_bad_files(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"this is": "not a tokenizer"')
    with pytest.raises(DataError, match=r"tokenizer\.json.*not a valid"):
        load_tokenizer(str(bad))
    missing = tmp_path / "nope" / "tok.json"
    with pytest.raises(DataError, match=r"nope/tok\.json not found"):
        load_tokenizer(str(missing))


def test_hf_tokenizer_without_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` raise ImportError
    with pytest.raises(DataError, match="pip install tokenizers"):
        HFTokenizer(tmp_path / "tokenizer.json")


def test_tokenizer_and_prepare_modules_do_not_import_torch() -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    probe = "import sys, speedtronic; print('torch' in sys.modules)"
    base = subprocess.run(
        [sys.executable, "-c", probe], env={"PYTHONPATH": src}, capture_output=True, text=True
    )
    if base.returncode != 0 or base.stdout.strip() == "True":
        pytest.skip("`import speedtronic` itself imports torch (or fails); nothing to check here")
    code = (
        "import sys; import speedtronic.engine.data.tokenizer, speedtronic.engine.data.prepare; "
        "from speedtronic.engine.data import ByteTokenizer; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": src}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- sources and batches ---------------------------------------------------------------------------


def test_labels_are_inputs_shifted_by_one_sequential(tmp_path: Path) -> None:
    text = make_text(60)
    raw = list(text.encode("utf-8"))
    src = tokenize_file(write(tmp_path, text), ByteTokenizer())
    T, B = 16, 4
    loader = TrainLoader(src, block_size=T, micro_batch_size=B, shuffle=False)
    for k, batch in enumerate(take(loader, 5)):
        x, y = batch["input_ids"], batch["labels"]
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
        for r in range(B):
            start = (k * B + r) * T  # sequential, non-overlapping windows
            assert x[r].tolist() == raw[start : start + T]
            assert y[r].tolist() == raw[start + 1 : start + T + 1]


def test_labels_are_inputs_shifted_by_one_shuffled() -> None:
    loader = TrainLoader(arange_source(5000), block_size=32, micro_batch_size=8, shuffle=True, seed=7)
    starts = set()
    for batch in take(loader, 10):
        x, y = batch["input_ids"], batch["labels"]
        assert torch.equal(y, x + 1)  # labels = next token, for every position
        assert torch.equal(x, x[:, :1] + torch.arange(32))  # each row is a contiguous window
        starts.update(x[:, 0].tolist())
    assert len(starts) == 80  # no window repeats within an epoch
    assert sorted(starts) != list(range(0, 80 * 32, 32))  # really shuffled


def test_synthetic_tokens_reproducible_and_learnable() -> None:
    a, b = SyntheticTokens(500, 20_000, seed=3), SyntheticTokens(500, 20_000, seed=3)
    c = SyntheticTokens(500, 20_000, seed=4)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert len(a) == 20_000 and int(a.tokens.min()) >= 0 and int(a.tokens.max()) < 500
    # Learnable: given the previous two tokens, the most common next token is right most of the time
    # (chance would be 1/500), so a model's loss can drop far below log(vocab).
    follow: dict[tuple[int, int], dict[int, int]] = {}
    toks = a.tokens.tolist()
    for ctx0, ctx1, nxt in zip(toks, toks[1:], toks[2:], strict=False):
        succ = follow.setdefault((ctx0, ctx1), {})
        succ[nxt] = succ.get(nxt, 0) + 1
    hits = sum(max(succ.values()) for succ in follow.values())
    assert hits / (len(toks) - 2) > 0.7


def test_byte_file_source_matches_in_memory(tmp_path: Path) -> None:
    path = write(tmp_path, make_text(300))
    disk, mem = ByteFileSource(path), tokenize_file(path, ByteTokenizer())
    assert len(disk) == len(mem)
    kw: dict[str, Any] = dict(block_size=24, micro_batch_size=3, shuffle=True, seed=5)
    assert_same(take(TrainLoader(disk, **kw), 6), take(TrainLoader(mem, **kw), 6))


def test_val_split_is_disjoint_from_train() -> None:
    n, T, B = 4000, 16, 4
    train, val = split_train_val(arange_source(n), 0.25)
    assert val is not None and len(train) == 3000 and len(val) == 1000
    loader = TrainLoader(train, block_size=T, micro_batch_size=B, shuffle=True, seed=0)
    seen = torch.cat([torch.cat([b["input_ids"], b["labels"]]).flatten() for b in take(loader, 2 * 46)])
    assert int(seen.max()) < 3000  # train never reaches into the held-out tokens
    vb = make_val_batches(val, block_size=T, micro_batch_size=B, max_batches=5)
    assert len(vb) == 5
    for k, batch in enumerate(vb):  # fixed sequential windows from the start of the val split
        assert batch["input_ids"][:, 0].tolist() == [3000 + (k * B + r) * T for r in range(B)]
        assert torch.equal(batch["labels"], batch["input_ids"] + 1)
    assert_same(vb, make_val_batches(val, block_size=T, micro_batch_size=B, max_batches=5))
    # Too short for one window, or no split at all: no validation batches.
    assert make_val_batches(val.slice(0, T), block_size=T, micro_batch_size=B, max_batches=5) == []
    assert make_val_batches(None, block_size=T, micro_batch_size=B, max_batches=5) == []
    assert split_train_val(arange_source(100), 0.0)[1] is None


@pytest.mark.parametrize("shuffle", [False, True])
def test_rank_shards_are_disjoint(shuffle: bool) -> None:
    T, B, W = 8, 4, 3
    src = arange_source(60 * T + 1)  # 60 windows (59 when shuffled: the grid shift costs one)
    per_epoch = 15 if not shuffle else 14
    steps = 5 if not shuffle else 4  # stay inside epoch 0 on every rank
    per_rank = []
    for rank in range(W):
        loader = TrainLoader(
            src, block_size=T, micro_batch_size=B, shuffle=shuffle, seed=1, rank=rank, world_size=W
        )
        assert loader.batches_per_epoch == per_epoch
        per_rank.append({int(s) for b in take(loader, steps) for s in b["input_ids"][:, 0]})
        assert loader.epoch == (steps * W + rank) // per_epoch
    for i in range(W):
        for j in range(i + 1, W):
            assert not per_rank[i] & per_rank[j]
    union = set().union(*per_rank)
    assert len(union) == steps * B * W
    if not shuffle:
        assert union == set(range(0, 60 * T, T))  # together the ranks cover the epoch exactly once
    else:
        assert len({s % T for s in union}) == 1  # one grid (shift) per epoch
    with pytest.raises(ValueError):
        TrainLoader(src, block_size=T, micro_batch_size=B, rank=3, world_size=3)


def test_too_little_data_is_a_data_error() -> None:
    with pytest.raises(DataError, match="block_size"):
        TrainLoader(arange_source(10), block_size=16, micro_batch_size=1)
    with pytest.raises(DataError, match="drop_last"):
        TrainLoader(arange_source(40), block_size=8, micro_batch_size=8, drop_last=True)
    loader = TrainLoader(arange_source(41), block_size=8, micro_batch_size=8, drop_last=False, shuffle=False)
    assert next(loader)["input_ids"].shape == (5, 8)  # the one partial batch is kept


def test_drop_last_false_keeps_partial_final_batch() -> None:
    loader = TrainLoader(
        arange_source(10 * 8 + 1), block_size=8, micro_batch_size=4, shuffle=False, drop_last=False
    )
    shapes = [b["input_ids"].shape[0] for b in take(loader, 6)]
    assert shapes == [4, 4, 2, 4, 4, 2]  # 10 windows per epoch, epochs wrap


# -- resume ----------------------------------------------------------------------------------------


def _check_resume(make_loader: Any, k: int = 5, total: int = 14) -> None:
    full = make_loader()
    expected = take(full, total)
    assert full.epoch >= 1  # the run crosses an epoch boundary, so wrap-around is covered too
    part = make_loader()
    take(part, k)
    state = part.state_dict()
    part.close()
    # The state is small and JSON-serialisable: ints and strings only.
    assert json.loads(json.dumps(state)) == state
    assert all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in state.values())
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert resumed.batches_served == k
    assert_same(take(resumed, total - k), expected[k:])


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ~700 bytes: with block 16 / batch 4 an epoch is ~10 batches, so 14 batches cross an epoch.
    return write(tmp_path_factory.mktemp("corpus"), make_text(40, seed=1))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    "kind", ["synthetic", "text", "text-on-disk", "dataset", "dataset-shards", "hf-stream"]
)
def test_resume_is_exact(kind: str, shuffle: bool, small_corpus: Path, tmp_path: Path) -> None:
    c = cfg(shuffle=shuffle, block_size=16, micro_batch_size=4, val_fraction=0.1)
    kwargs: dict[str, Any] = {}
    if kind == "synthetic":
        c.synthetic, c.num_tokens, c.vocab_size = True, 700, 97
    elif kind in ("text", "text-on-disk"):
        c.text_path = str(small_corpus)
        if kind == "text-on-disk":
            kwargs["memory_budget_bytes"] = 100
    elif kind in ("dataset", "dataset-shards"):
        # dataset-shards: many small shard files, so windows cross shard boundaries.
        shards = {"shard_tokens": 50, "unit_bytes": 40} if kind == "dataset-shards" else {}
        prepare_dataset(small_corpus, tmp_path / "ds", val_fraction=0.1, chunk_bytes=64, **shards)
        c.dataset = str(tmp_path / "ds")
    else:
        c.text_path = str(small_corpus)
        c.tokenizer = str(make_hf_tokenizer(tmp_path / "tok.json", make_text(200)))
        c.block_size, c.micro_batch_size = 8, 3
        kwargs.update(memory_budget_bytes=100, chunk_bytes=48)  # many chunks → non-zero skip states

    def make() -> TrainLoader:
        return build_data(c, **kwargs).train

    assert make().streaming == (kind == "hf-stream")
    _check_resume(make)


def test_resume_refuses_mismatched_state() -> None:
    a = TrainLoader(arange_source(2000), block_size=16, micro_batch_size=4, seed=1)
    take(a, 3)
    b = TrainLoader(arange_source(2000), block_size=16, micro_batch_size=4, seed=2)
    with pytest.raises(ConfigError, match="seed: saved 1 now 2"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(a.state_dict(), strict=False)  # explicit opt-out continues from the counter
    assert b.batches_served == 3
    with pytest.raises(ConfigError, match="data source changed"):
        b.load_state_dict({**a.state_dict(), "kind": "stream"})
    with pytest.raises(ValueError, match="malformed"):
        b.load_state_dict({k: v for k, v in a.state_dict().items() if k != "batches_served"}, strict=False)


def test_workers_give_identical_batches(small_corpus: Path) -> None:
    src = tokenize_file(small_corpus, ByteTokenizer())
    kw: dict[str, Any] = dict(block_size=16, micro_batch_size=4, shuffle=True, seed=11)
    expected = take(TrainLoader(src, **kw), 12)  # no workers: indexed directly, no DataLoader
    with TrainLoader(src, num_workers=2, prefetch_factor=2, **kw) as par:
        got = take(par, 5)
        state = par.state_dict()
        assert state["batches_served"] == 5  # prefetched batches are not counted as served
        got += take(par, 3)
        par.load_state_dict(state)  # rewinding a worker loader discards its prefetched batches
        got5 = take(par, 7)
    assert_same(got, expected[:8])
    assert_same(got5, expected[5:])


def test_stream_worker_gives_identical_batches(small_corpus: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(str(make_hf_tokenizer(tmp_path / "tok.json", make_text(200))))
    stream = TextStream(small_corpus, tok, chunk_bytes=40)
    kw: dict[str, Any] = dict(block_size=8, micro_batch_size=3, shuffle=False)
    expected = take(TrainLoader(stream, **kw), 10)
    with TrainLoader(stream, num_workers=2, **kw) as par:
        assert par.num_workers == 1  # a sequential stream uses at most one worker
        got = take(par, 4)
        state = par.state_dict()
    resumed = TrainLoader(stream, num_workers=1, **kw)
    resumed.load_state_dict(state)
    assert_same(got + take(resumed, 6), expected)
    resumed.close()


# -- streaming -------------------------------------------------------------------------------------


class _CountingFile:
    """Wraps a binary file and records the size of every read."""

    def __init__(self, f: Any, reads: list[int]) -> None:
        self._f, self._reads = f, reads

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            self._reads.append(-1)  # unbounded read: the whole rest of the file
        data = self._f.read(n)
        self._reads.append(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads: list[int] = []
    real_open = open

    def counting_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        return _CountingFile(real_open(path, mode, *args, **kwargs), reads)

    monkeypatch.setattr(sources_mod, "open", counting_open, raising=False)
    return reads


def test_large_text_streams_with_byte_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = make_text(12_000, seed=2)
    path = write(tmp_path, text)
    size = path.stat().st_size
    assert size > 200_000
    reads = _count_reads(monkeypatch)
    c = cfg(text_path=str(path), block_size=64, micro_batch_size=8, shuffle=True)
    bundle = build_data(c, memory_budget_bytes=16_384)
    assert "read from disk" in bundle.describe()
    per_epoch = bundle.train.batches_per_epoch
    assert per_epoch is not None and per_epoch * 8 * 64 > 0.8 * size
    for _ in range(per_epoch):  # one full pass over the file
        next(bundle.train)
    bundle.val_batches()
    assert -1 not in reads and max(reads) <= 65  # one window at a time, never the whole file
    assert sum(reads) > 0.8 * size


def test_large_text_streams_with_hf_tokenizer_in_bounded_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = make_text(20_000, seed=3)
    path = write(tmp_path, text)
    size = path.stat().st_size
    tok_path = make_hf_tokenizer(tmp_path / "tok.json", make_text(300))
    reads = _count_reads(monkeypatch)
    c = cfg(text_path=str(path), tokenizer=str(tok_path), block_size=32, micro_batch_size=4, val_batches=2)
    bundle = build_data(c, memory_budget_bytes=16_384, chunk_bytes=4096)
    assert bundle.train.streaming and "streamed" in bundle.describe()
    for _ in range(20):  # warm up: one-time lazy imports inside torch's DataLoader
        next(bundle.train)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        while bundle.train.epoch == 0:  # read the rest of the training split
            next(bundle.train)
        next(bundle.train)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert -1 not in reads and max(reads) <= 4096
    assert sum(reads) > 0.85 * size
    # Constant memory: a chunk of text and its tokens (plus interpreter free lists), not the file,
    # whose text alone is `size` bytes and whose token list would be several times that.
    assert peak - before < size // 2
    assert len(bundle.val_batches()) == 2


def test_stream_matches_in_memory_tokenisation_and_shards(tmp_path: Path) -> None:
    path = write(tmp_path, make_text(150, seed=4))
    tok = load_tokenizer(str(make_hf_tokenizer(tmp_path / "tok.json", make_text(200))))
    whole = tok.encode(path.read_text(encoding="utf-8"))
    # Chunks end at newlines, so with lines shorter than a chunk the tokens equal whole-file encoding.
    assert max(len(line) for line in path.read_bytes().splitlines()) < 100
    stream = TextStream(path, tok, chunk_bytes=100)
    T = 10
    wins = [w for w, _ in stream.windows(T + 1, T, stream.first_pos())]
    assert wins == [whole[i * T : i * T + T + 1] for i in range((len(whole) - 1) // T)]
    # Two ranks read disjoint, line-aligned byte ranges that tile the file.
    s0, s1 = stream.shard(0, 2), stream.shard(1, 2)
    assert (s0.start, s0.end, s1.start, s1.end) == (0, s0.end, s0.end, path.stat().st_size)
    assert path.read_bytes()[s0.end - 1 : s0.end] == b"\n"
    train, val = stream.split(0.2)
    assert val is not None and train.end == val.start and abs(val.num_bytes - 0.2 * stream.num_bytes) < 80


# -- build_data ------------------------------------------------------------------------------------


def test_build_data_text(tmp_path: Path) -> None:
    text = make_text(300, seed=5)
    path = write(tmp_path, text, "mytext.txt")
    bundle = build_data(cfg(text_path=str(path), val_fraction=0.2, val_batches=2))
    assert isinstance(bundle, DataBundle) and isinstance(bundle.tokenizer, ByteTokenizer)
    n = len(text.encode())
    n_val = int(n * 0.2)
    assert bundle.describe() == f"text mytext.txt: {n - n_val:,} train / {n_val:,} val tokens, byte tokenizer"
    assert bundle.vocab_size == 256
    vb = bundle.val_batches()
    assert len(vb) == 2 and vb[0]["input_ids"].shape == (4, 16)
    raw = list(text.encode())
    assert vb[0]["input_ids"][0].tolist() == raw[n - n_val : n - n_val + 16]
    assert_same(vb, bundle.val_batches())
    assert bundle.train.pin_memory is False
    assert build_data(cfg(text_path=str(path), pin_memory=True), device_type="cuda").train.pin_memory is True
    assert build_data(cfg(text_path=str(path), pin_memory=True), device_type="cpu").train.pin_memory is False
    with pytest.raises(DataError, match=r"nope\.txt"):
        build_data(cfg(text_path=str(tmp_path / "nope.txt")))
    with pytest.raises(ConfigError, match="vocab_size"):
        build_data(cfg(text_path=str(path), vocab_size=100))
    assert build_data(cfg(text_path=str(path), vocab_size=512)).vocab_size == 512


def test_build_data_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, make_text(200))
    prepare_dataset(path, tmp_path / "ds")
    both = dict(text_path=str(path), dataset=str(tmp_path / "ds"))
    synth = build_data(cfg(synthetic=True, num_tokens=5000, vocab_size=1000, **both))
    assert synth.vocab_size == 1000 and synth.describe().startswith("synthetic")
    assert int(next(synth.train)["input_ids"].max()) < 1000
    ds = build_data(cfg(**both))
    assert ds.describe().startswith("dataset ds:") and ds.vocab_size == 256
    assert_same(
        take(ds.train, 3), take(build_data(cfg(text_path=str(path))).train, 3)
    )  # same tokens, same batches
    assert build_data(cfg(text_path=str(path))).describe().startswith("text corpus.txt")


def test_build_data_default_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        text = read_default_corpus()
    except DataError as exc:
        assert "text_path" in str(exc)  # the message says how to proceed without it
        with pytest.raises(DataError):
            build_data(cfg())
        return
    bundle = build_data(cfg(block_size=64, micro_batch_size=2))
    assert len(text) > 100_000 and "built-in" in bundle.describe()
    assert next(bundle.train)["input_ids"].shape == (2, 64)


def test_real_corpus_smoke() -> None:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not present")
    bundle = build_data(cfg(text_path=str(SHAKESPEARE), block_size=128, micro_batch_size=8))
    assert bundle.describe().startswith("text tinyshakespeare.txt: 1,003,855 train / 111,539 val tokens")
    batch = next(bundle.train)
    row = batch["input_ids"][0].tolist()
    assert bundle.tokenizer.decode(row).encode() == bytes(row)  # real text, bytes round-trip
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
