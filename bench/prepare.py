"""`speedtronic data prepare` throughput: MB/s with 1 and N workers against a `datasets.map` baseline.

    python bench/prepare.py [--mb 100] [--workers N] [--tokenizer bpe|byte] [--baseline-python PATH]

Generates a JSONL corpus of ``--mb`` megabytes (documents are paragraphs of the embedded corpus,
numbered so none repeat) and a small byte-level BPE tokenizer with an EOS token, then times, each in
a fresh process:

- ``speedtronic data prepare corpus.jsonl`` with ``--workers 1`` and ``--workers N``;
- the nanoGPT-style baseline: ``datasets.load_dataset("json")`` + ``.map(tokenize, num_proc=N)`` +
  writing the ids to one memmapped ``.bin`` (what nanoGPT's ``prepare.py`` does), with the same
  tokenizer. It runs under ``--baseline-python`` (default: this interpreter) and is skipped, saying
  so, when that interpreter cannot import ``datasets``.

Printed per run: seconds, input MB/s, peak resident memory of the largest process of the run,
and the ratios to the baseline (above 1: speedtronic is faster). Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASELINE = r"""
import sys, numpy as np
from datasets import load_dataset
from tokenizers import Tokenizer
path, tok_path, out, num_proc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = Tokenizer.from_file(tok_path)
eos = tok.token_to_id("<|endoftext|>")
def process(example):
    ids = tok.encode(example["text"], add_special_tokens=False).ids
    ids.append(eos)
    return {"ids": ids, "len": len(ids)}
ds = load_dataset("json", data_files=path, split="train", cache_dir=out + "/cache")
ds = ds.map(process, remove_columns=["text"], num_proc=num_proc)
total = int(np.sum(ds["len"], dtype=np.uint64))
arr = np.memmap(out + "/train.bin", dtype=np.uint16, mode="w+", shape=(total,))
idx = 0
for shard in range(16):  # nanoGPT writes in batches of shards
    batch = ds.shard(num_shards=16, index=shard, contiguous=True).with_format("numpy")
    chunk = np.concatenate(batch["ids"]) if len(batch) else np.zeros(0, np.uint16)
    arr[idx : idx + len(chunk)] = chunk
    idx += len(chunk)
arr.flush()
print(total)
"""


def make_corpus(directory: Path, mb: int) -> Path:
    sys.path.insert(0, str(ROOT / "src"))
    from speedtronic.engine.data.text import read_default_corpus_bytes

    paragraphs = [p for p in read_default_corpus_bytes().decode("utf-8").split("\n\n") if p.strip()]
    path = directory / "corpus.jsonl"
    target, written, i = mb << 20, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            line = json.dumps({"text": f"{i}. " + paragraphs[i % len(paragraphs)]}) + "\n"
            f.write(line)
            written += len(line)
            i += 1
    return path


def make_tokenizer(directory: Path, corpus: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample = corpus.read_text(encoding="utf-8")[: 2 << 20]
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([sample], trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


# Runs the command from a small process: a child's peak RSS starts at its parent's at fork, so
# measuring from this (big) process would report our own memory, not the command's.
_MEASURE = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
    "sys.exit(r.returncode)"
)


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(seconds, peak RSS in MiB of the largest process of the command, stdout); exits on failure."""
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss"
        start = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", _MEASURE, str(rss_file), *cmd], env=env, capture_output=True, text=True
        )
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return seconds, int(rss_file.read_text()) / 1024, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="corpus size in MB (the issue asks for >= 100)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--tokenizer", choices=["bpe", "byte"], default="bpe")
    parser.add_argument("--baseline-python", default=sys.executable)
    args = parser.parse_args()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        corpus = make_corpus(d, args.mb)
        mb = corpus.stat().st_size / 1e6
        tok = make_tokenizer(d, corpus)
        tok_arg = str(tok) if args.tokenizer == "bpe" else "byte"
        print(f"corpus: {mb:.1f} MB of JSONL, tokenizer {args.tokenizer}, {args.workers} workers for N")
        rows: dict[str, tuple[float, float]] = {}
        for workers in sorted({1, args.workers}):
            cmd = [
                sys.executable,
                "-m",
                "speedtronic",
                "data",
                "prepare",
                str(corpus),
                "--out",
                str(d / f"st{workers}"),
                "--tokenizer",
                tok_arg,
                "--workers",
                str(workers),
                "--json",
            ]
            seconds, rss, out = timed(cmd, env)
            tokens = json.loads(out.strip().splitlines()[-1])
            rows[f"speedtronic --workers {workers}"] = (seconds, rss)
            print(
                f"speedtronic --workers {workers}: {seconds:.2f} s, {mb / seconds:.1f} MB/s, peak RSS {rss:.0f} MiB, "
                f"{tokens['train_tokens'] + tokens['val_tokens']:,} tokens"
            )
        probe = subprocess.run(
            [args.baseline_python, "-c", "import datasets, tokenizers, numpy"], capture_output=True
        )
        if args.tokenizer != "bpe":
            print("baseline: skipped (it uses the BPE tokenizer; run with --tokenizer bpe)")
        elif probe.returncode != 0:
            print(
                f"baseline: skipped ({args.baseline_python} cannot import datasets/tokenizers/numpy: "
                "pip install datasets, or pass --baseline-python)"
            )
        else:
            (d / "base").mkdir()
            cmd = [
                args.baseline_python,
                "-c",
                BASELINE,
                str(corpus),
                str(tok),
                str(d / "base"),
                str(args.workers),
            ]
            seconds, rss, out = timed(cmd, {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
            print(
                f"datasets.map(num_proc={args.workers}): {seconds:.2f} s, {mb / seconds:.1f} MB/s, "
                f"peak RSS {rss:.0f} MiB, {int(out.split()[-1]):,} tokens"
            )
            for name, (s, _) in rows.items():
                print(f"ratio {name} / datasets.map: {seconds / s:.2f}x throughput")


if __name__ == "__main__":
    main()
