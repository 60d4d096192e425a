"""data.sources: a weighted mixture — shares by weight, deterministic from the seed, each source's position
in the checkpoint, exact resume after kill -9 and on another number of ranks, per-source val loss, and the
config's checks (engine/data/mixture.py, engine/data/source_spec.py, config/data_sources.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import speedtronic
from speedtronic.config import load_config
from speedtronic.engine.data.mixture import MixtureLoader, WeightedSource
from speedtronic.engine.data.sources import TokenArray
from speedtronic.errors import CheckpointError, ConfigError

SRC = Path(speedtronic.__file__).resolve().parents[1]
SPAN = 20  # source j's tokens are j*SPAN .. j*SPAN + SPAN - 1, so a row names its source


def arrays(sizes: tuple[int, ...] = (5000, 3000, 2000)) -> list[TokenArray]:
    g = torch.Generator().manual_seed(0)
    return [
        TokenArray(torch.randint(j * SPAN, (j + 1) * SPAN, (n,), generator=g)) for j, n in enumerate(sizes)
    ]


def loader(
    weights=(0.5, 0.3, 0.2), *, seed: int = 7, rank: int = 0, world: int = 1, micro: int = 4
) -> MixtureLoader:
    names = ["web", "code", "books"]
    parts = [WeightedSource(n, w, a) for n, w, a in zip(names, weights, arrays(), strict=False)]
    return MixtureLoader(parts, block_size=8, micro_batch_size=micro, seed=seed, rank=rank, world_size=world)


def source_of(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // SPAN).tolist()


def take(it: MixtureLoader, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b, strict=True)
    )


def test_three_sources_get_their_weights_over_10k_sequences() -> None:
    mix = loader(micro=10)
    counts = [0, 0, 0]
    for batch in take(mix, 1000):  # 10,000 sequences
        for j in source_of(batch):
            counts[j] += 1
        assert torch.equal(batch["labels"][:, :-1], batch["input_ids"][:, 1:])
    shares = [c / 10_000 for c in counts]
    for share, weight in zip(shares, (0.5, 0.3, 0.2), strict=True):
        assert abs(share - weight) <= 0.02, shares
    # The loader's own count of each source's position is what the batches held.
    assert list(mix.positions().values()) == counts
    assert {k: v["tokens"] for k, v in mix.tokens_by_source().items()} == {
        "web": counts[0] * 8,
        "code": counts[1] * 8,
        "books": counts[2] * 8,
    }


def test_the_mix_is_a_function_of_the_seed() -> None:
    assert same(take(loader(), 30), take(loader(), 30))
    assert not same(take(loader(), 30), take(loader(seed=8), 30))


def test_worker_processes_give_the_same_batches() -> None:
    names = ["web", "code", "books"]
    parts = [WeightedSource(n, w, a) for n, w, a in zip(names, (0.5, 0.3, 0.2), arrays(), strict=True)]
    pooled = MixtureLoader(parts, block_size=8, micro_batch_size=4, seed=7, num_workers=1)
    try:
        assert same(take(pooled, 12), take(loader(), 12))
    finally:
        pooled.close()


def global_stream(world: int, batches_per_rank: int, state: dict | None = None) -> tuple[list, dict]:
    """Global batches g = i * world + r of `world` ranks (resumed from `state`), and rank 0's state after."""
    ranks = [loader(rank=r, world=world) for r in range(world)]
    if state is not None:
        for r in ranks:
            r.load_state_dict(state)
    per_rank = [take(r, batches_per_rank) for r in ranks]
    stream = [per_rank[g % world][g // world] for g in range(world * batches_per_rank)]
    return stream, ranks[0].state_dict()


def test_resume_on_another_number_of_ranks_continues_every_source() -> None:
    reference = loader()
    expected = take(reference, 24)
    first, state = global_stream(2, 6)  # global batches 0..11 on two ranks
    assert same(first, expected[:12])
    assert (
        state["sources"]["web"]["position"]
        + state["sources"]["code"]["position"]
        + state["sources"]["books"]["position"]
        == 12 * 4
    )
    for world in (1, 3, 4):  # 12 micro-batches divide between 1, 3 and 4 ranks
        rest, after = global_stream(world, 12 // world, state)
        assert same(rest, expected[12:24]), world
        assert {k: v["position"] for k, v in after["sources"].items()} == reference.positions()
    with pytest.raises(ConfigError, match="does not divide"):
        loader(world=5).load_state_dict(state)


def test_resume_in_one_process_gives_the_same_batches() -> None:
    expected = take(loader(), 20)
    first = loader()
    head = take(first, 7)
    second = loader()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))  # what a checkpoint keeps
    assert same(head + take(second, 13), expected)


def test_new_weights_continue_each_source_from_its_position() -> None:
    first = loader()
    take(first, 10)
    state = first.state_dict()
    changed = loader(weights=(0.2, 0.2, 0.6))
    changed.load_state_dict(state)
    assert changed.positions() == first.positions()
    # Source j's next sequences are its windows from its saved position on, in its own order.
    fresh = loader()
    want = {j: [] for j in range(3)}
    for batch in take(changed, 10):
        for row, j in zip(batch["input_ids"], source_of(batch), strict=True):
            want[j].append(row)
    for j, rows in want.items():
        position = state["sources"][["web", "code", "books"][j]]["position"]
        plan, tokens = fresh.plans[j], fresh.sources[j].tokens
        for n, row in enumerate(rows):
            start = plan.starts(position + n)[0]
            assert torch.equal(row, tokens.read(start, 8)), (j, n)


def test_a_hostile_or_foreign_state_is_refused() -> None:
    state = loader().state_dict()
    with pytest.raises(CheckpointError, match="out of range"):
        loader().load_state_dict({**state, "batches_served": 2**60})
    with pytest.raises(CheckpointError, match="out of range"):
        loader().load_state_dict({**state, "batches_served": -1})
    with pytest.raises(ConfigError, match=r"not a data\.sources mixture"):
        loader().load_state_dict({**state, "kind": "windows"})
    grown = {**state, "sources": {**state["sources"], "web": {**state["sources"]["web"], "num_tokens": 1}}}
    with pytest.raises(ConfigError, match="'web' has"):
        loader().load_state_dict(grown)


# -- the config ----------------------------------------------------------------------------------


def config(tmp_path: Path, *sets: str):
    return load_config({"run": {"name": "m", "output_dir": str(tmp_path / "out")}}, list(sets))


def test_config_checks_weights_names_and_exclusive_fields(tmp_path: Path) -> None:
    good = config(tmp_path, "data.sources=[{path: a/web.jsonl.gz, weight: 2}, {dataset: d/code}]")
    assert [s.key for s in good.data.sources] == ["web", "code"]
    bad = {
        "data.sources=[{path: a.txt, weight: 0}]": "greater than 0",
        "data.sources=[{path: a.txt}, {path: b/a.txt}]": "both named 'a'",
        "data.sources=[{path: 'x/*.txt'}]": "needs a name",
        "data.sources=[{path: a.txt, dataset: d}]": "exactly one of path",
        "data.sources=[]": "is empty",
        "data.sources=[{path: a.txt, weight: 1.0e-4}, {path: b.txt}]": "below 1/4096",
    }
    for setting, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            config(tmp_path, setting)
    with pytest.raises(ConfigError, match=r"data\.sources and data\.text_path are both set"):
        config(tmp_path, "data.text_path=a.txt", "data.sources=[{path: b.txt}]")


def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    child = {
        **os.environ,
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        **(env or {}),
    }
    child["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *args],
        cwd=cwd,
        env=child,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_validate_exits_2_with_one_line_for_a_mixture_beside_text_path(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\n")
    result = cli(
        "validate", "smoke", "--set", "data.synthetic=false", "--set", "data.text_path=a.txt",
        "--set", "data.sources=[{path: a.txt}]", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.sources and data.text_path" in lines[0], result.stderr


# -- real runs -----------------------------------------------------------------------------------

RUN = """
run: {{name: mix, max_steps: {steps}, log_every: 1, eval_every: 0, seed: 5}}
model: {{n_layer: 1, n_head: 2, d_model: 32, dropout: 0.0}}
data:
  sources:
    - {{path: web.txt, weight: 0.5}}
    - {{path: code.txt, weight: 0.3}}
    - {{path: books.jsonl, weight: 0.2}}
  block_size: 16
  micro_batch_size: 4
  {batch}
  val_batches: 2
precision: {{mode: fp32}}
compile: {{enabled: false}}
optimizer: {{lr: 3.0e-3}}
checkpoint: {{every_steps: 2}}
"""


def corpus(folder: Path, steps: int, batch: str = "") -> Path:
    folder.mkdir()
    (folder / "web.txt").write_text("".join(f"the web page number {i} says hello\n" for i in range(600)))
    (folder / "code.txt").write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(600)))
    books = "".join(
        json.dumps({"text": f"Chapter {i}. Once upon a time, a tale."}) + "\n" for i in range(300)
    )
    (folder / "books.jsonl").write_text(books)
    (folder / "run.yaml").write_text(RUN.format(steps=steps, batch=batch))
    return folder


def losses(folder: Path) -> dict[int, float]:
    lines = (folder / "runs" / "mix" / "metrics.jsonl").read_text().splitlines()
    out: dict[int, float] = {}
    for event in map(json.loads, lines):
        if event["event"] == "step":
            out[event["step"]] = event["loss"]  # a resumed run repeats steps: the later value wins
    return out


def report(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def latest_step(folder: Path) -> int:
    try:
        name = (folder / "runs" / "mix" / "checkpoints" / "latest").read_text().strip()
        return int(name.removeprefix("step_").removesuffix(".pt"))
    except (OSError, ValueError):
        return -1


@pytest.mark.slow
def test_kill_9_and_resume_trains_on_the_same_batches(tmp_path: Path) -> None:
    steps = 40
    env = {"SPEEDTRONIC_DATA_CACHE": str(tmp_path / "cache")}
    whole = corpus(tmp_path / "whole", steps)
    straight = report(cli("train", "run.yaml", "--json", cwd=whole, env=env))
    assert set(straight["data_sources"]) == {"web", "code", "books"}
    assert sum(s["tokens"] for s in straight["data_sources"].values()) == straight["tokens"]

    killed = corpus(tmp_path / "killed", steps)
    child = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "train", "run.yaml"],
        cwd=killed,
        env={**child, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while latest_step(killed) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    stopped = latest_step(killed)
    assert 4 <= stopped < steps
    resumed = report(cli("train", "run.yaml", "--json", cwd=killed, env=env))
    assert resumed["resumed_from"] and resumed["steps"] == steps
    assert losses(killed) == losses(whole)  # fp32, one thread: every step's batch was the same
    assert resumed["data_sources"] == straight["data_sources"]
    last = [json.loads(line) for line in (killed / "runs" / "mix" / "metrics.jsonl").read_text().splitlines()]
    step = [e for e in last if e["event"] == "step"][-1]
    assert {k: step[f"tokens/{k}"] for k in straight["data_sources"]} == {
        k: v["tokens"] for k, v in straight["data_sources"].items()
    }


@pytest.mark.slow
def test_two_ranks_then_one_continue_each_source(tmp_path: Path) -> None:
    env = {"SPEEDTRONIC_DATA_CACHE": str(tmp_path / "cache")}
    batch = "target_batch_size: 8"  # the global batch is fixed: 2 ranks × 4 or 1 rank × 4 × 2
    single = corpus(tmp_path / "single", 6, batch)
    one = report(cli("train", "run.yaml", "--json", cwd=single, env=env))
    moved = corpus(tmp_path / "moved", 6, batch)
    half = report(cli("train", "run.yaml", "--json", "--max-steps", "3", "--nproc", "2", cwd=moved, env=env))
    assert half["steps"] == 3
    assert sum(s["tokens"] for s in half["data_sources"].values()) == half["tokens"]
    rest = report(cli("train", "run.yaml", "--json", cwd=moved, env=env))
    assert rest["resumed_from"] and rest["steps"] == 6
    assert rest["data_sources"] == one["data_sources"]  # every source continued where it stood
    a, b = losses(single), losses(moved)
    for step in range(1, 7):  # the same global batches; only the order of float sums differs
        assert b[step] == pytest.approx(a[step], rel=1e-4), step

    # Each source's validation loss: in the metrics (`runs`), and scored again by `eval`.
    runs = report(cli("runs", "--json", cwd=moved))["runs"]
    assert set(runs[0]["val_by_source"]) == {"web", "code", "books"}
    scored = report(
        cli(
            "eval", "runs/mix/checkpoints", "--data", "web=web.txt", "--data", "code.txt", "--json", cwd=moved
        )
    )
    by_source = scored["data_sources"]
    assert set(by_source) == {"web", "code"}
    low, high = sorted(r["loss"] for r in by_source.values())
    assert low <= scored["loss"] <= high and scored["n"] == sum(r["tokens"] for r in by_source.values())


@pytest.mark.slow
def test_the_noniid_bench_runs_and_writes_its_arms(tmp_path: Path) -> None:
    out = tmp_path / "noniid.json"
    bench = SRC.parent / "bench" / "noniid.py"
    child = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [
        sys.executable,
        str(bench),
        "--seeds",
        "1",
        "--steps",
        "6",
        "--inner-steps",
        "3",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, env=child, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    pooled = json.loads(out.read_text())["pooled"]
    assert {"single", "dp", "diloco_mix", "diloco_noniid", "closed_mix", "closed_noniid"} <= set(pooled)
    assert "pooled over 1 seeds" in result.stdout


def test_datasets_folders_and_globs_open_and_jsonl_is_prepared_once(tmp_path: Path, monkeypatch) -> None:
    from speedtronic.engine.data import build_data, prepare_dataset

    monkeypatch.setenv("SPEEDTRONIC_DATA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "code.txt").write_text("".join(f"def f{i}(x): return x * {i}\n" for i in range(500)))
    prepare_dataset(tmp_path / "code.txt", tmp_path / "code")
    (tmp_path / "docs").mkdir()
    for n in range(2):
        lines = (json.dumps({"body": f"Document {n}.{i}: once upon a time."}) for i in range(200))
        (tmp_path / "docs" / f"part{n}.jsonl").write_text("\n".join(lines) + "\n")
    entries = (
        f"[{{dataset: {tmp_path / 'code'}}}, {{path: {tmp_path / 'docs'}, text_field: body, weight: 2}}]"
    )
    cfg = config(tmp_path, f"data.sources={entries}", "data.block_size=16", "data.micro_batch_size=4").data
    bundle = build_data(cfg)
    assert set(bundle.val_by_source) == {"code", "docs"} and bundle.weights == {"code": 1.0, "docs": 2.0}
    assert all(len(bundle.source_val_batches()[name]) > 0 for name in ("code", "docs"))
    (cached,) = (tmp_path / "cache").glob("docs-*/meta.json")
    stamp = cached.stat().st_mtime_ns
    again = build_data(cfg)  # the prepared copy is found, not made again
    assert cached.stat().st_mtime_ns == stamp
    assert same(take(bundle.train, 5), take(again.train, 5))
    text = b"".join(bytes(row.tolist()) for b in take(again.train, 20) for row in b["input_ids"])
    assert b"Document" in text and b"def f" in text  # both sources, the JSONL by its text_field
