"""Builds the shipped evaluation tasks (src/speedtronic/resources/tasks/) from the embedded corpus.

Both are drawn from the corpus's held-out end — the last `data.val_fraction` (10%) of it, which a
run on the default corpus never trains on — with a fixed seed, so running this again writes the same
files (tests/test_eval.py checks that they are fresh):

* shakespeare-cloze: a passage, then its real next line or the same line with its words shuffled
  (2 choices, chance 1/2). Both choices have the same characters, so acc and acc_norm agree.
* shakespeare-next-line: a passage, then its real next line or one of 3 other lines of the held-out
  text (4 choices, chance 1/4); the choices differ in length, so acc_norm is the suite's metric.

Usage: PYTHONPATH=src python scripts/make_eval_tasks.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from speedtronic.engine.data.sources import split_point
from speedtronic.engine.data.text import read_default_corpus_bytes

OUT = Path(__file__).resolve().parent.parent / "src" / "speedtronic" / "resources" / "tasks"
EXAMPLES = 200
CONTEXT_LINES = 3


def held_out_lines() -> list[str]:
    data = read_default_corpus_bytes()
    text = data[split_point(len(data), 0.1) :].decode("utf-8", errors="ignore")
    return text.split("\n")[1:]  # the first line may be cut by the split


def candidates(lines: list[str]) -> list[int]:
    """Indices of lines worth predicting: 4+ words, after 3 non-empty lines of the same speech."""
    found = []
    for i in range(CONTEXT_LINES, len(lines)):
        line = lines[i]
        if len(line.split()) < 4 or line.endswith(":"):
            continue
        if all(lines[j].strip() for j in range(i - CONTEXT_LINES, i)):
            found.append(i)
    return found


def context_of(lines: list[str], i: int) -> str:
    return "\n".join(lines[i - CONTEXT_LINES : i]) + "\n"


def cloze(lines: list[str], rng: random.Random) -> list[dict]:
    out = []
    for i in rng.sample(candidates(lines), EXAMPLES * 2):
        words = lines[i].split()
        shuffled = words[:]
        for _ in range(10):
            rng.shuffle(shuffled)
            if shuffled != words:
                break
        if shuffled == words:
            continue
        real, fake = " ".join(words), " ".join(shuffled)
        label = rng.randrange(2)
        choices = [real, fake] if label == 0 else [fake, real]
        out.append({"context": context_of(lines, i), "choices": choices, "label": label})
        if len(out) == EXAMPLES:
            break
    return out


def next_line(lines: list[str], rng: random.Random) -> list[dict]:
    pool = candidates(lines)
    out = []
    for i in rng.sample(pool, EXAMPLES):
        others = [
            lines[j] for j in rng.sample(pool, 8) if abs(j - i) > CONTEXT_LINES and lines[j] != lines[i]
        ][:3]
        choices = [lines[i], *others]
        rng.shuffle(choices)
        out.append({"context": context_of(lines, i), "choices": choices, "label": choices.index(lines[i])})
    return out


def write(name: str, examples: list[dict]) -> None:
    body = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples)
    (OUT / f"{name}.jsonl").write_text(body, encoding="utf-8")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    lines = held_out_lines()
    write("shakespeare-cloze", cloze(lines, random.Random(27)))
    write("shakespeare-next-line", next_line(lines, random.Random(28)))


if __name__ == "__main__":
    main()
