"""Issue 26's second-hour traps, each through the CLI with the input the issue names:

- `init shakespeare mine.yaml` names the run `mine`; `validate` says when a checkpoint of the run exists
  and what resuming it does; a resumed run whose weights do not fit names the fix (another run.name);
- a warm-up not shorter than the run is clamped, with a warning (`--set run.max_steps=50`);
- `data prepare` with the byte tokenizer says that documents are glued; "1 bad record"; no "at at";
- piped, the first log line comes at step 1;
- a usage error is one line; `train smok` says "did you mean smoke?";
- `shapes` reports n_head's own value, cuts nothing at 80 columns, refuses `--gpu H10`;
- rerunning a finished run says it is complete and how to extend it;
- `runs --json` / `configs --json` print one object;
- `validate` of a CPU run does not import torch;
- examples/train_reference.py and examples/diloco_master.yaml run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from speedtronic.config import load_config
from speedtronic.engine.device import _gpu_possible

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ROOT / "src" / "speedtronic" / "resources" / "configs"
TINY = ["--set", "run.max_steps=2", "--set", "data.val_batches=1"]


def last_json(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(result.stdout.splitlines()[-1])


def test_init_names_the_run_after_the_file_it_writes(run_cli, tmp_path: Path) -> None:
    out = run_cli("init", "shakespeare", "mine.yaml", "--json")
    assert out.returncode == 0, out.stderr
    assert last_json(out)["run_name"] == "mine"
    written = load_config(tmp_path / "mine.yaml")
    shipped = load_config(PACKAGED / "shakespeare.yaml")
    assert written.run.name == "mine" and written.output_dir() == "runs/mine"
    assert written.model_dump(exclude={"run"}) == shipped.model_dump(exclude={"run"})
    assert written.run.model_dump(exclude={"name"}) == shipped.run.model_dump(exclude={"name"})
    # A stem that is no run name is made one; the default path keeps the shipped name.
    assert run_cli("init", "smoke", "my copy!.yaml").returncode == 0
    assert load_config(tmp_path / "my copy!.yaml").run.name == "my-copy-"
    assert run_cli("init", "smoke").returncode == 0
    assert load_config(tmp_path / "smoke.yaml").run.name == "smoke"


def test_a_finished_run_a_reused_name_and_validate(run_cli, tmp_path: Path) -> None:
    trained = run_cli("train", "smoke", *TINY, "--json")
    assert trained.returncode == 0, trained.stderr
    checkpoint = last_json(trained)["checkpoint"]

    # validate says that a checkpoint exists and what train would do with it.
    done = last_json(run_cli("validate", "smoke", *TINY, "--json"))["resume"]
    assert done["step"] == 2 and done["complete"] is True and done["checkpoint"] == checkpoint
    assert "already complete" in done["says"] and "run.max_steps=N" in done["says"]
    longer = run_cli("validate", "smoke", "--set", "run.max_steps=4", "--set", "data.val_batches=1")
    assert longer.returncode == 0, longer.stderr
    assert "resumes it and trains steps 3…4" in longer.stderr and "another run.name" in longer.stderr
    fresh = last_json(run_cli("validate", "smoke", "--set", "run.name=other", "--json"))
    assert fresh["resume"] is None

    # Rerunning the finished run: complete, how to extend it, no evaluation, no "0 tok/s".
    again = run_cli("train", "smoke", *TINY)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("complete: run smoke is at step 2 of run.max_steps=2"), again.stdout
    assert "--set run.max_steps=4" in again.stdout and checkpoint in again.stdout
    for wrong in ("steps 3…2", "eval step", "0 tok/s", "checkpoint none"):
        assert wrong not in again.stdout + again.stderr, wrong
    stopped = run_cli("train", "smoke", "--max-steps", "2", "--set", "data.val_batches=1")
    assert stopped.returncode == 0, stopped.stderr  # at the --max-steps stop of a longer run
    assert stopped.stdout.startswith("nothing to train: run smoke is already at step 2 (--max-steps 2)")
    assert "at most run.max_steps=30" in stopped.stdout and "eval step" not in stopped.stderr
    as_json = last_json(run_cli("train", "smoke", *TINY, "--json"))
    assert as_json["complete"] is True and as_json["checkpoint"] == checkpoint and as_json["steps"] == 2

    # An edited model under the same run.name: the error names the real fix.
    edited = run_cli("train", "smoke", "--set", "run.max_steps=4", "--set", "model.d_model=96")
    assert edited.returncode == 1
    (line,) = edited.stderr.strip().splitlines()[-1:]
    assert line.startswith("error:") and "the weights do not fit" in line
    assert "another run.name (--set run.name=NEW)" in line, line


def test_a_warmup_not_shorter_than_the_run_is_clamped_with_a_warning(run_cli) -> None:
    out = run_cli("validate", "shakespeare", "--set", "run.max_steps=50", "--json")
    assert out.returncode == 0, out.stderr
    plan = last_json(out)["plan"]
    assert plan["warmup_steps"] == 2 and plan["schedule_steps"] == 50  # 5% of the run, the default rule
    (warning,) = plan["warnings"]
    assert "scheduler.warmup_steps 50 is not shorter than run.max_steps 50" in warning
    text = run_cli("validate", "shakespeare", "--set", "run.max_steps=50")
    assert "warning: scheduler.warmup_steps 50" in text.stderr
    # The shipped run (600 steps) keeps its 50-step warm-up exactly, without a warning.
    shipped = last_json(run_cli("validate", "shakespeare", "--json"))["plan"]
    assert shipped["warmup_steps"] == 50 and shipped["warnings"] == []
    # Over half the run (the newcomer's `--set run.max_steps=60`): kept as asked, but said.
    kept = last_json(run_cli("validate", "shakespeare", "--set", "run.max_steps=60", "--json"))["plan"]
    assert kept["warmup_steps"] == 50 and kept["schedule_steps"] == 60
    (said,) = kept["warnings"]
    assert "scheduler.warmup_steps 50 is 83% of run.max_steps 60" in said and "last 10 steps" in said


def test_data_prepare_says_the_byte_tokenizer_glues_documents(run_cli, tmp_path: Path) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "one `Annotated`."}\n{"text": "<a href=x>two</a>"}\n{"text": "three"}\n')
    glued = run_cli("data", "prepare", str(docs), "--out", str(tmp_path / "glued"))
    assert glued.returncode == 0, glued.stderr
    assert "no EOS token" in glued.stderr and "--separator" in glued.stderr
    marked = run_cli("data", "prepare", str(docs), "--out", str(tmp_path / "marked"), "--separator", "\n\n")
    assert marked.returncode == 0 and "no EOS token" not in marked.stderr
    # The prepared tokens are what they were: the note changes nothing on disk.
    meta = json.loads((tmp_path / "glued" / "meta.json").read_text())
    assert meta["separator"] is None or meta["separator"] == []

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "unterminated\n{"text": "fine too"}\n')
    refused = run_cli("data", "prepare", str(bad), "--out", str(tmp_path / "bad"), "--json")
    assert refused.returncode != 0
    error = last_json(refused)["error"]
    assert "at at" not in error and "column" in error, error
    skipped = run_cli("data", "prepare", str(bad), "--out", str(tmp_path / "skip"), "--skip-bad")
    assert skipped.returncode == 0, skipped.stderr
    assert "skipped 1 bad record " in skipped.stderr and "bad records" not in skipped.stderr


def test_the_first_log_line_comes_at_step_1_when_piped(run_cli) -> None:
    out = run_cli("train", "shakespeare", "--max-steps", "2", "--set", "data.val_batches=1")
    assert out.returncode == 0, out.stderr
    steps = [line for line in out.stderr.splitlines() if " step 1/2 · loss " in line]
    assert steps, out.stderr  # log_every is 25: without the first-step line nothing came before step 25


def test_a_usage_error_is_one_line_and_a_mistyped_config_gets_a_suggestion(run_cli) -> None:
    bogus = run_cli("train", "shakespeare", "--bogus")
    assert bogus.returncode == 2
    assert bogus.stderr.splitlines() == ["error: No such option: --bogus (see `speedtronic train --help`)"]
    missing = run_cli("train")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1, missing.stderr
    typo = run_cli("train", "smok")
    assert typo.returncode == 2 and len(typo.stderr.splitlines()) == 1
    assert "did you mean smoke?" in typo.stderr
    assert "did you mean shakespeare?" in run_cli("init", "shakespere").stderr


def test_shapes_reports_the_fields_value_and_cuts_nothing(run_cli) -> None:
    args = ["shapes", "shakespeare", "--set", "model.d_model=120", "--device", "cuda", "--precision", "bf16"]
    found = {w["code"]: w for w in last_json(run_cli(*args, "--gpu", "H100", "--json"))["warnings"]}
    head = found["SHAPE_HEAD_DIM"]
    assert (head["field"], head["value"], head["suggested"]) == ("model.n_head", 4, 3)  # 120 / 3 = 40
    assert "head dim 30" in head["reason"]
    narrow = {"COLUMNS": "80"}
    table = run_cli(*args, "--gpu", "H100", env=narrow)
    assert table.returncode == 0, table.stderr
    assert "…" not in table.stdout and head["reason"] in table.stdout
    plugins = run_cli("plugins", "--all", env=narrow)
    assert "…" not in plugins.stdout and "speedtronic.builtin.optimizers" in plugins.stdout
    unknown = run_cli(*args, "--gpu", "H10")
    assert unknown.returncode == 2 and "did you mean H100" in unknown.stderr
    assert run_cli(*args, "--gpu", "NVIDIA A100-SXM4-80GB").returncode == 0


def test_listings_print_one_json_object(run_cli) -> None:
    configs = last_json(run_cli("configs", "--json"))
    assert isinstance(configs, dict) and "smoke" in {c["name"] for c in configs["configs"]}
    runs = last_json(run_cli("runs", "--json"))
    assert runs == {"runs": []}


NO_TORCH = """
import sys
from speedtronic.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit_:
    assert exit_.code in (0, None), exit_.code
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.skipif(_gpu_possible(), reason="a GPU driver is present: planning for auto asks torch")
def test_validate_of_a_cpu_run_does_not_import_torch(run_cli) -> None:
    for argv in (["validate", "shakespeare"], ["validate", "smoke", "--json"]):
        out = run_cli(*argv, python_code=NO_TORCH)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[-1] == "torch imported: False", out.stdout[-400:]


def test_the_reference_example_trains_resumes_and_samples(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_reference.py"),
            "--steps",
            "6",
            "--out",
            str(tmp_path / "ref"),
            "--json",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    summary = last_json(out)
    assert summary["first_steps"] == 3 and summary["steps"] == 6
    assert summary["resumed_from"].endswith("step_00000003.pt")
    assert Path(summary["checkpoint"]).is_file() and len(summary["sample"]) > 0


def test_the_diloco_master_example_runs(run_cli, tmp_path: Path) -> None:
    tiny = [
        "run.max_steps=4",
        "run.log_every=2",
        "distributed.sync.inner_steps=2",
        "checkpoint.every_steps=2",
        "data.block_size=32",
        "data.micro_batch_size=4",
        "data.val_batches=1",
        "distributed.rounds.initial_grace=1",
        "distributed.rounds.max_wait=3",
    ]
    sets = [arg for value in tiny for arg in ("--set", value)]
    example = ROOT / "examples" / "diloco_master.yaml"
    out = run_cli("master", example, "--repo", f"file://{tmp_path / 'bus'}", *sets, "--json")
    assert out.returncode == 0, out.stderr
    result = last_json(out)
    assert result["outer_step"] == 2 and result["finished"] == ["master"] and result["rejected"] == []
    assert len(result["applied"]) == 2 and result["train"]["steps"] == 4
