"""The LM Evaluation Harness on speedtronic models (interop/lm_eval_harness.py), offline, on local
task YAML files: the three request types on a model whose log-probabilities are known by hand, and
`speedtronic eval CKPT --harness TASK --harness-include DIR` on a trained checkpoint, whose harness
accuracy equals `speedtronic eval --task` on the same examples. Skips where the optional `lm-eval`
extra is absent (CI installs only `.[dev]`)."""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from test_eval import Bigram, logp, table, train_tiny

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="the lm-eval extra is not installed (pip install 'speedtronic-lm[lm-eval]')",
)

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def task_yaml(folder: Path, name: str, data: Path, body: str) -> None:
    """A harness task reading a local JSONL file (the `json` loader: no download)."""
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{body}"
    )


MC = (
    'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
    'doc_to_target: "{{label}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n'
    "    aggregation: mean\n    higher_is_better: true\n  - metric: acc_norm\n    aggregation: mean\n"
    "    higher_is_better: true\n"
)


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def test_the_three_request_types_by_hand(tmp_path: Path, offline: None) -> None:
    from speedtronic.engine.data.tokenizer import ByteTokenizer
    from speedtronic.interop.lm_eval_harness import SpeedtronicLM, run_harness

    # Multiple choice: "q" vs "qrrr" after "x" — the short one has the larger sum, the long one the
    # larger mean per character (acc and acc_norm disagree); then an easy one both get right.
    mc = write_jsonl(
        tmp_path / "mc.jsonl",
        [
            {"context": "x", "choices": ["q", "qrrr"], "label": 1},
            {"context": "xq", "choices": ["r", "a"], "label": 0},
        ],
    )
    roll = write_jsonl(tmp_path / "roll.jsonl", [{"text": "qrrrr"}, {"text": "abc"}])
    gen = write_jsonl(
        tmp_path / "gen.jsonl", [{"context": "xq", "answer": "rrrr"}, {"context": "xa", "answer": "rrrr"}]
    )
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task_yaml(tasks, "local_mc", mc, MC)
    task_yaml(
        tasks,
        "local_roll",
        roll,
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n",
    )
    task_yaml(
        tasks,
        "local_gen",
        gen,
        'output_type: generate_until\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
        'target_delimiter: ""\ngeneration_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n",
    )
    lm = SpeedtronicLM(model=Bigram(table()), tokenizer=ByteTokenizer(), max_seq_len=16)
    report = run_harness(lm, ["local_mc", "local_roll", "local_gen"], include=[str(tasks)])
    results = report["results"]
    assert results["local_mc"]["acc,none"] == 0.5 and results["local_mc"]["acc_norm,none"] == 1.0
    # Rolling: without an EOS the first byte is context only; the harness divides by every byte.
    nll = -(logp("q", "r") + 3 * logp("r", "r") + logp("a", "b") + logp("b", "c"))
    assert results["local_roll"]["bits_per_byte,none"] == pytest.approx(nll / (8 * math.log(2)), rel=1e-5)
    # Greedy after "q" is "r" forever; after "a" every logit is 0, so token 0 (not "rrrr").
    assert results["local_gen"]["exact_match,none"] == 0.5

    # The request methods themselves: (log-likelihood, is greedy) by hand.
    class Request:
        def __init__(self, *args: Any) -> None:
            self.args = args

    got = lm.loglikelihood([Request("x", "q"), Request("xq", "rr")])
    assert got[0][0] == pytest.approx(logp("x", "q"), abs=1e-5) and got[0][1] is False
    assert got[1][0] == pytest.approx(logp("q", "r") + logp("r", "r"), abs=1e-5) and got[1][1] is True
    # Generation stops at max_gen_toks, or at a stop string, which is cut off with what follows it.
    assert lm.generate_until([Request("xq", {"until": ["\n"], "max_gen_toks": 3})]) == ["rrr"]
    assert lm.generate_until([Request("xq", {"until": ["rr"], "max_gen_toks": 8})]) == [""]
    with pytest.raises(Exception, match="decodes greedily"):
        lm.generate_until([Request("xq", {"do_sample": True})])


def test_eval_harness_on_a_checkpoint_matches_its_own_task_scoring(
    run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    checkpoints = train_tiny(run_cli, tmp_path / "run")
    rows = [
        {"context": "ROMEO:\nWhat light through yonder ", "choices": ["window", "kettle", "w"], "label": 0},
        {"context": "To be, or not to be, that is the ", "choices": ["question", "q"], "label": 0},
        {"context": "Now is the winter of our ", "choices": ["discontent", "toast", "dis"], "label": 0},
        {"context": "A horse! a horse! my kingdom for a ", "choices": ["horse", "h", "cow"], "label": 0},
    ]
    data = write_jsonl(tmp_path / "lines.jsonl", rows)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    task_yaml(tasks, "lines", data, MC)
    env = OFFLINE | {"HF_HOME": str(tmp_path / "hf_home")}
    result = run_cli(
        "eval",
        checkpoints,
        "--harness",
        "lines",
        "--harness-include",
        tasks,
        "--task",
        data,
        "--json",
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    mine, theirs = report["tasks"]["lines"], report["harness"]["results"]["lines"]
    # Two implementations of the same definitions over the same examples and model.
    assert theirs["acc,none"] == pytest.approx(mine["acc"]) and theirs["acc_norm,none"] == pytest.approx(
        mine["acc_norm"]
    )
    assert theirs["acc_stderr,none"] == pytest.approx(mine["acc_stderr"])
    human = run_cli("eval", checkpoints, "--harness", "lines", "--harness-include", tasks, env=env)
    assert human.returncode == 0 and "harness lines: acc " in human.stdout, human.stderr[-2000:]
    unknown = run_cli("eval", checkpoints, "--harness", "no_such_task_xyz", env=env)
    assert unknown.returncode == 2 and "unknown task(s) no_such_task_xyz" in unknown.stderr
