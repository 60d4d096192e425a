"""`speedtronic eval`: scoring on a model whose log-probabilities are known by hand (acc, acc_norm,
exact match, loss and bits per byte), task files and suites (bad ones named by file:line, exit 2),
the CORE aggregate, the shipped tasks, and the command on real checkpoints, a sharded one included."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from speedtronic.engine.data.tokenizer import ByteTokenizer
from speedtronic.engine.eval.data import documents
from speedtronic.engine.eval.evaluate import aggregate, score_documents, score_tasks
from speedtronic.errors import ConfigError
from speedtronic.eval_tasks import centred, load_tasks, mean_stderr, read_suite, read_task, shipped_dir

REPO = Path(__file__).resolve().parents[1]

# A bigram model: the logits after token t are row t of a fixed table, so every log-probability is
# a closed form: log p(b | a) = T[a][b] - log(sum_j exp(T[a][j])).
V = 256
HIGH = 10.0  # T[q][r] = T[r][r] = HIGH; every other entry 0


def table() -> torch.Tensor:
    t = torch.zeros(V, V)
    t[ord("q"), ord("r")] = HIGH
    t[ord("r"), ord("r")] = HIGH
    return t


class Bigram(nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.table = nn.Parameter(logits.clone())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]


def logp(a: str, b: str) -> float:
    """By hand, from the table's definition."""
    row_high = 1 if a in "qr" else 0
    norm = math.log((V - row_high) + row_high * math.exp(HIGH))
    value = HIGH if (a in "qr" and b == "r") else 0.0
    return value - norm


def write_task(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_choice_likelihoods_acc_and_acc_norm_by_hand(tmp_path: Path) -> None:
    # "q" alone vs "qrrr": the short choice has the larger sum, the long one the larger mean per
    # character, so acc and acc_norm disagree; the label is the long one.
    task = read_task(
        write_task(tmp_path / "crafted.jsonl", [{"context": "x", "choices": ["q", "qrrr"], "label": 1}])
    )
    short, long_ = logp("x", "q"), logp("x", "q") + logp("q", "r") + 2 * logp("r", "r")
    assert short > long_ and long_ / 4 > short / 1  # the crafted disagreement, by hand
    result = score_tasks(Bigram(table()), ByteTokenizer(), [task], max_seq_len=16)["crafted"]
    assert result["acc"] == 0.0 and result["acc_norm"] == 1.0
    assert result["chance"] == 0.5 and result["accuracy"] == result["acc"] and result["centred"] == -1.0

    # The likelihoods themselves, through the batched scorer, padding included (lengths differ).
    from speedtronic.engine.eval.evaluate import score

    seqs = [list(b"xq"), list(b"xqrrr")]
    scored = score(Bigram(table()), seqs, [1, 1], batch_size=2)
    assert scored[0].logprob == pytest.approx(short, abs=1e-5)
    assert scored[1].logprob == pytest.approx(long_, abs=1e-5)
    assert [s.tokens for s in scored] == [1, 4]


def test_completion_is_exact_match_of_the_greedy_continuation(tmp_path: Path) -> None:
    rows = [
        {"context": "q", "answer": "rrr"},  # greedy after q is r, after r is r: right
        {"context": "q", "answer": "rq"},  # greedy after r is r, not q: wrong
        {"context": "xq", "answer": "r"},
    ]
    task = read_task(write_task(tmp_path / "greedy.jsonl", rows))
    assert task.kind == "completion" and task.chance == 0.0
    result = score_tasks(Bigram(table()), ByteTokenizer(), [task], max_seq_len=16)["greedy"]
    assert result["exact_match"] == pytest.approx(2 / 3)
    assert result["exact_match_stderr"] == pytest.approx(math.sqrt((2 / 3) * (1 / 3) / 2))
    assert result["centred"] == pytest.approx(2 / 3)


def test_long_contexts_keep_their_end(tmp_path: Path) -> None:
    # A context longer than the window is cut from the left: the choice is still scored whole.
    task = read_task(
        write_task(tmp_path / "long.jsonl", [{"context": "x" * 50 + "q", "choices": ["r", "x"], "label": 0}])
    )
    result = score_tasks(Bigram(table()), ByteTokenizer(), [task], max_seq_len=8)["long"]
    assert result["acc"] == 1.0


def test_loss_and_bits_per_byte_by_hand(tmp_path: Path) -> None:
    text = tmp_path / "doc.txt"
    text.write_text("qrrr")
    model, tok = Bigram(table()), ByteTokenizer()
    # The byte tokenizer has no EOS: the first byte is context, the 3 after it are scored.
    nll = -(logp("q", "r") + 2 * logp("r", "r"))
    got = score_documents(model, tok, documents(str(text), tok), max_seq_len=2)  # windows of 2
    assert got["tokens"] == 3 and got["bytes"] == 3 and got["documents"] == 1
    assert got["loss"] == pytest.approx(nll / 3, rel=1e-4)
    assert got["bits_per_byte"] == pytest.approx(nll / (math.log(2) * 3), rel=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(nll / 3), rel=1e-4)
    cut = score_documents(model, tok, documents(str(text), tok), max_seq_len=16, max_tokens=2)
    assert cut["tokens"] == 2 and cut["bytes"] == 2
    assert cut["loss"] == pytest.approx(-(logp("q", "r") + logp("r", "r")) / 2, rel=1e-4)


class CharTokenizer:
    """One token per character, id 0 the EOS: a multi-byte character is one token (as in BPE)."""

    spec = "chars"
    eos_id = 0

    def __init__(self, alphabet: str) -> None:
        self.alphabet = alphabet
        self.vocab_size = len(alphabet) + 1

    def encode(self, text: str) -> list[int]:
        return [self.alphabet.index(c) + 1 for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[i - 1] for i in ids if i > 0)


def test_bits_per_byte_divides_by_utf8_bytes_not_tokens(tmp_path: Path) -> None:
    tok = CharTokenizer("éa")
    logits = torch.zeros(3, 3)
    logits[0, 1] = 2.0  # after EOS: é likely
    model = Bigram(logits)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text(json.dumps({"text": "éa"}) + "\n" + json.dumps({"body": 1}) + "\n")
    with pytest.raises(Exception, match=r"docs.jsonl:2: text field 'text' is missing"):
        list(documents(str(jsonl), tok))
    jsonl.write_text(json.dumps({"text": "éa"}) + "\n")
    got = score_documents(model, tok, documents(str(jsonl), tok), max_seq_len=8)
    # The EOS goes first as context, so both characters are scored: 2 tokens, 3 UTF-8 bytes.
    nll = -((2.0 - math.log(math.exp(2.0) + 2)) + (0.0 - math.log(3)))
    assert got["tokens"] == 2 and got["bytes"] == 3
    assert got["bits_per_byte"] == pytest.approx(nll / (math.log(2) * 3), rel=1e-4)


# ------------------------------------------------------------------------------- task files, suites


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad\.jsonl:3: not valid JSON"),
        (
            '{"context": "a", "choices": ["b"], "label": 0}',
            r"bad\.jsonl:3: 'choices' must be a list of at least 2",
        ),
        ('{"context": "a", "choices": ["b", "c"], "label": 2}', r"bad\.jsonl:3: 'label' must be the index"),
        ('{"context": "a", "answer": "b"}', r"bad\.jsonl:3: a completion example in a multiple-choice task"),
        ('{"context": 3, "answer": "b"}', r"bad\.jsonl:3: 'context' must be a non-empty string"),
        ('["a"]', r"bad\.jsonl:3: an example must be a JSON object"),
    ],
)
def test_a_bad_task_line_is_named_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    good = json.dumps({"context": "a", "choices": ["b", "c"], "label": 0})
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        read_task(path)


def test_suites_resolve_names_and_paths_and_refuse_unknown_keys(tmp_path: Path) -> None:
    write_task(tmp_path / "mine.jsonl", [{"context": "a", "answer": "b"}])
    suite = tmp_path / "suite.yaml"
    suite.write_text("tasks:\n  - mine.jsonl\n  - {task: shakespeare-next-line, metric: acc_norm}\n")
    tasks = read_suite(suite).tasks
    assert [t.name for t in tasks] == ["mine", "shakespeare-next-line"]
    assert tasks[1].metric == "acc_norm" and tasks[1].chance == 0.25
    suite.write_text("tasks:\n  - {task: mine.jsonl, metric: acc}\n")
    with pytest.raises(ConfigError, match=r"metric 'acc' does not apply to a completion task"):
        read_suite(suite)
    suite.write_text("tasks: [mine.jsonl]\nweights: [1]\n")
    with pytest.raises(ConfigError, match=r"suite .*suite.yaml: must be a mapping with a 'tasks' list"):
        read_suite(suite)
    with pytest.raises(ConfigError, match=r"--task 'nope': no such file nor shipped task"):
        load_tasks(["nope"])
    with pytest.raises(ConfigError, match=r"two tasks are named 'shakespeare-cloze'"):
        load_tasks(["shakespeare-cloze", "shakespeare"])


def test_core_aggregate_is_the_mean_of_accuracies_centred_on_chance() -> None:
    assert centred(0.5, 0.5) == 0.0 and centred(1.0, 0.25) == 1.0
    assert centred(0.625, 0.25) == pytest.approx(0.5)
    results = {
        "a": {"accuracy": 0.75, "centred": centred(0.75, 0.5)},  # 0.5
        "b": {"accuracy": 0.4, "centred": centred(0.4, 0.0)},  # 0.4
    }
    assert aggregate(results) == {"a": 0.75, "b": 0.4, "aggregate": pytest.approx(0.45)}
    assert mean_stderr([True]) is None
    assert mean_stderr([True, False, True, True]) == pytest.approx(math.sqrt(0.75 * 0.25 / 3))


def test_shipped_tasks_are_fresh_and_held_out() -> None:
    spec = importlib.util.spec_from_file_location("make_eval_tasks", REPO / "scripts" / "make_eval_tasks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = module.held_out_lines()
    import random

    for name, build, seed in (
        ("shakespeare-cloze", module.cloze, 27),
        ("shakespeare-next-line", module.next_line, 28),
    ):
        want = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in build(lines, random.Random(seed)))
        assert (shipped_dir() / f"{name}.jsonl").read_text(encoding="utf-8") == want, (
            f"{name}.jsonl is stale: run scripts/make_eval_tasks.py"
        )
    tasks = {t.name: t for t in load_tasks(["shakespeare"])}
    assert set(tasks) == {"shakespeare-cloze", "shakespeare-next-line"}
    assert tasks["shakespeare-cloze"].chance == 0.5 and len(tasks["shakespeare-cloze"].examples) == 200
    assert tasks["shakespeare-next-line"].metric == "acc_norm"


# ------------------------------------------------------------------------------------- the command

TINY = """
run: {name: tiny, max_steps: 3, log_every: 1, eval_every: 0, seed: 5}
model: {n_layer: 1, n_head: 2, d_model: 32, dropout: 0.0}
data: {block_size: 32, micro_batch_size: 4, val_batches: 2}
precision: {mode: fp32}
checkpoint: {every_steps: 3}
distributed: {strategy: STRATEGY}
"""


def train_tiny(run_cli: Callable[..., Any], cwd: Path, strategy: str = "ddp") -> Path:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "run.yaml").write_text(TINY.replace("STRATEGY", strategy))
    result = run_cli("train", cwd / "run.yaml", "--json", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "tiny" / "checkpoints"


def eval_json(run_cli: Callable[..., Any], *args: object) -> dict[str, Any]:
    result = run_cli("eval", *args, "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_eval_command_json_on_a_trained_checkpoint(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    checkpoints = train_tiny(run_cli, tmp_path / "run")
    text = tmp_path / "held-out.txt"
    text.write_text("ROMEO:\nWhat light through yonder window breaks?\n" * 20)
    report = eval_json(run_cli, checkpoints, "--data", text, "--task", "shakespeare", "--max-tokens", 500)
    assert {"bits_per_byte", "loss", "accuracy", "n", "perplexity", "tasks"} <= set(report)
    assert report["n"] == 500 and report["data"]["bytes"] == 500  # bytes: the byte tokenizer
    assert report["bits_per_byte"] == pytest.approx(report["loss"] / math.log(2))
    assert set(report["accuracy"]) == {"shakespeare-cloze", "shakespeare-next-line", "aggregate"}
    tasks = report["tasks"]
    assert tasks["shakespeare-cloze"]["n"] == 200 and tasks["shakespeare-next-line"]["chance"] == 0.25
    mean = sum(t["centred"] for t in tasks.values()) / 2
    assert report["accuracy"]["aggregate"] == pytest.approx(mean)
    assert report["step"] == 3
    # The same numbers in-process, from the same checkpoint (the command adds nothing of its own).
    from speedtronic.engine.eval.evaluate import evaluate_checkpoint

    direct = evaluate_checkpoint(
        checkpoints, data=str(text), tasks=load_tasks(["shakespeare"]), max_tokens=500
    )
    assert direct["loss"] == pytest.approx(report["loss"], rel=1e-6)
    assert direct["accuracy"] == pytest.approx(report["accuracy"])
    human = run_cli("eval", checkpoints, "--task", "shakespeare-cloze")
    assert (
        human.returncode == 0 and "aggregate (CORE)" in human.stdout and "shakespeare-cloze" in human.stdout
    )


def test_eval_usage_errors_exit_2(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n{"context": "a", "choices": []}\n')
    result = run_cli("eval", tmp_path / "missing", "--task", bad)
    assert result.returncode == 2
    assert f"{bad}:2: 'choices' must be a list of at least 2 strings" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = run_cli("eval", tmp_path, "--json")
    assert result.returncode == 2 and "give --data PATH" in result.stdout


def test_eval_help_does_not_import_torch(run_cli: Callable[..., Any]) -> None:
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom speedtronic.cli import build_app\n"
        "r = CliRunner().invoke(build_app(), ['eval', '--help'])\n"
        "print(r.exit_code, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    result = run_cli(python_code=code)
    assert result.stdout.strip() == "0 []", result.stderr


@pytest.mark.slow
def test_a_sharded_checkpoint_scores_as_its_whole_twin(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """One process trains the same run twice, sharded (fsdp: a .dcp folder) and whole (ddp): the
    same weights, so eval reads the shards back to the same numbers."""
    sharded = train_tiny(run_cli, tmp_path / "fsdp", "fsdp")
    whole = train_tiny(run_cli, tmp_path / "ddp", "ddp")
    assert (sharded / "step_00000003.dcp").is_dir() and (whole / "step_00000003.pt").is_file()
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 10)
    a = eval_json(run_cli, sharded, "--data", text, "--task", "shakespeare-cloze")
    b = eval_json(run_cli, whole, "--data", text, "--task", "shakespeare-cloze")
    assert a["checkpoint"].endswith(".dcp") and b["checkpoint"].endswith(".pt")
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert a["accuracy"]["shakespeare-cloze"] == pytest.approx(b["accuracy"]["shakespeare-cloze"], abs=0.02)


# ------------------------------------------------------------------------------- during training


def test_run_eval_tasks_land_in_metrics_and_the_runs_table(
    run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    cwd = tmp_path / "run"
    cwd.mkdir()
    write_task(
        cwd / "mine.jsonl", [{"context": "ROMEO", "answer": ":"}, {"context": "JULIET", "answer": ":"}]
    )
    config = TINY.replace("STRATEGY", "ddp").replace(
        "eval_every: 0, seed: 5}", "eval_every: 2, seed: 5, eval_tasks: [shakespeare-cloze, mine.jsonl]}"
    )
    (cwd / "run.yaml").write_text(config)
    result = run_cli("train", cwd / "run.yaml", "--json", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tasks CORE" in result.stderr
    events = [json.loads(line) for line in (cwd / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [2, 3]
    for e in evals:
        assert set(e["tasks"]) == {"shakespeare-cloze", "mine"}
        assert e["tasks"]["mine"]["metric"] == "exact_match" and e["tasks"]["mine"]["n"] == 2
        centred_mean = sum(t["centred"] for t in e["tasks"].values()) / 2
        assert e["core"] == pytest.approx(centred_mean)
    # The final evaluation scores the final weights: `speedtronic eval` on the last checkpoint agrees.
    report = eval_json(run_cli, cwd / "runs" / "tiny" / "checkpoints", "--task", "shakespeare-cloze")
    assert report["accuracy"]["shakespeare-cloze"] == pytest.approx(
        evals[-1]["tasks"]["shakespeare-cloze"]["accuracy"]
    )
    table = run_cli("runs", "--json", cwd=cwd)
    (run,) = json.loads(table.stdout.strip().splitlines()[-1])["runs"]
    assert run["core"] == pytest.approx(evals[-1]["core"]) and set(run["accuracy"]) == {
        "shakespeare-cloze",
        "mine",
    }

    (cwd / "run.yaml").write_text(
        config.replace("mine.jsonl", "missing.jsonl").replace("name: tiny", "name: other")
    )
    result = run_cli("train", cwd / "run.yaml", cwd=cwd)
    assert result.returncode == 2
    assert "run.eval_tasks 'missing.jsonl': no such file nor shipped task" in result.stderr


def test_runs_fold_task_metrics_into_curves_and_plot_panels(tmp_path: Path) -> None:
    from speedtronic.runs import summarize, text_plot

    metrics = tmp_path / "metrics.jsonl"
    events = [
        {"event": "eval", "step": step, "val_loss": 2.0, "core": core, "tasks": {"cloze": {"accuracy": acc}}}
        for step, core, acc in ((10, 0.1, 0.55), (20, 0.3, 0.65), (20, 0.4, 0.7))  # a resume redid 20
    ]
    events.append({"event": "eval", "step": 30, "core": "bad", "tasks": {}})  # untrusted: skipped
    metrics.write_text("".join(json.dumps(e) + "\n" for e in events))
    run = summarize("r", metrics)
    assert run.evals == {"core": [(10, 0.1), (20, 0.4)], "cloze": [(10, 0.55), (20, 0.7)]}
    assert run.core == 0.4 and run.accuracy == {"cloze": 0.7}
    assert text_plot([run], metric="core").startswith("core by step")
    assert "task metrics: cloze, core" in text_plot([run], metric="nope")
    pytest.importorskip("matplotlib")
    from speedtronic.runs import plot_png

    out = plot_png([run], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_diloco_master_scores_the_global_model_on_run_eval_tasks(tmp_path: Path) -> None:
    """node_eval.Evaluator (the master's view of the global model) scores run.eval_tasks beside the
    val loss (master/report.py's status shows them as global_eval_tasks); scoring directly agrees."""
    from speedtronic.config import load_config
    from speedtronic.diloco import codec
    from speedtronic.diloco.launch import build_reference
    from speedtronic.diloco.node_eval import Evaluator

    raw = {
        "run": {"name": "m", "seed": 3, "eval_tasks": ["shakespeare-cloze"]},
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {"block_size": 32, "micro_batch_size": 4, "val_batches": 2},
    }
    cfg = load_config(raw)
    reference = build_reference(cfg)
    model = reference.model
    weights = codec.snapshot(model)
    evaluate = Evaluator.for_run(cfg, *reference)
    assert evaluate is not None and evaluate.tasks is None
    loss = evaluate(weights)
    assert math.isfinite(loss)
    got = evaluate.tasks
    assert (
        set(got["tasks"]) == {"shakespeare-cloze"}
        and got["core"] == got["tasks"]["shakespeare-cloze"]["centred"]
    )
    direct = score_tasks(model, ByteTokenizer(), load_tasks(["shakespeare-cloze"]), max_seq_len=32)
    assert got["tasks"]["shakespeare-cloze"]["accuracy"] == direct["shakespeare-cloze"]["accuracy"]
