"""Faults and bad inputs through the real CLI: each is one `error:` line with the documented exit code
(1 runtime, 2 usage or config, 130 interrupted), no traceback, and nothing saved before it changes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import SRC_DIR

CONFIG = """
run: {name: f, max_steps: 8, log_every: 100, eval_every: 0}
model: {n_layer: 1, n_head: 2, d_model: 32}
data: {synthetic: true, vocab_size: 64, num_tokens: 20000, block_size: 16, micro_batch_size: 4, val_batches: 1}
checkpoint: {every_steps: 2, keep_last: 5}
logging: {hooks: []}
precision: {mode: fp32}
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` and a hash of its bytes."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def one_error_line(result: Any, code: int, *fragments: str) -> str:
    """Assert exit `code`, no traceback, exactly one `error:` line on stderr holding `fragments`."""
    assert result.returncode == code, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def json_error(result: Any, code: int) -> dict[str, Any]:
    """With --json, a failure still ends stdout with one JSON object naming the error and the code."""
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last["exit_code"] == code and last["error"], last
    return last


# A run whose parameters turn NaN right after step `at`, between logging steps (log_every is 100).
POISON = """
import sys, torch
from speedtronic.engine.trainer import Trainer
at = int(sys.argv.pop(1))
real_step = Trainer.train_step
def train_step(self):
    out = real_step(self)
    if self.step == at:
        with torch.no_grad():
            self.params[0].fill_(float("nan"))
    return out
Trainer.train_step = train_step
from speedtronic.cli import main
main()
"""


@pytest.mark.parametrize(
    ("at", "what"), [(3, "loss became non-finite at step 4"), (4, "parameters are non-finite")]
)
def test_non_finite_run_never_saves_a_checkpoint(
    run_cli: Callable[..., Any], tmp_path: Path, config_file: Path, at: int, what: str
) -> None:
    checkpoints = tmp_path / "runs" / "f" / "checkpoints"
    assert run_cli("train", config_file, "--max-steps", "2").returncode == 0
    before = snapshot(checkpoints)
    result = run_cli(at, "train", config_file, "--json", python_code=POISON)
    one_error_line(result, 1, what, "before saving step 4", "the last checkpoint is untouched")
    assert json_error(result, 1)
    assert snapshot(checkpoints) == before  # `latest` still names step 2, the last finite one
    assert (checkpoints / "latest").read_text().strip() == "step_00000002.pt"


def test_file_size_limit_during_save_is_one_line(
    run_cli: Callable[..., Any], tmp_path: Path, config_file: Path
) -> None:
    checkpoints = tmp_path / "runs" / "f" / "checkpoints"
    assert run_cli("train", config_file, "--max-steps", "2").returncode == 0
    before = snapshot(checkpoints)
    limited = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); "
        "from speedtronic.cli import main; main()"
    )
    result = run_cli("train", config_file, "--max-steps", "4", python_code=limited)
    one_error_line(result, 1, "could not write checkpoint", "step_00000004.pt", "checkpoint.directory")
    assert snapshot(checkpoints) == before  # no partial file, no temp file, `latest` unchanged


BOMB = """
run: {name: bomb}
model:
  options:
    a: &a [x, x, x, x, x, x, x, x, x, x]
    b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
    c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
    d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
    e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
    f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]
    g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f, *f]
    h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g, *g]
    i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h, *h]
"""


def test_yaml_alias_bomb_nested_in_model_options_is_refused_at_once(
    run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    result = run_cli("validate", path, "--json")
    one_error_line(result, 2, "model.options", "expands to more than 100,000 values")
    assert json_error(result, 2)["field"].startswith("model.options")


def test_an_oversized_config_file_is_refused(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("run: {name: x}\n" + "# padding\n" * 200_000)
    one_error_line(run_cli("validate", path), 2, "a run config is at most")


@pytest.mark.parametrize(
    ("field", "value"),
    [("model.d_model", 1099511627776), ("model.n_layer", 10**12), ("data.block_size", 10**12)],
)
def test_absurd_sizes_are_refused_before_allocating_naming_the_field(
    run_cli: Callable[..., Any], tmp_path: Path, config_file: Path, field: str, value: int
) -> None:
    result = run_cli("train", config_file, "--set", f"{field}={value}", "--json")
    one_error_line(result, 2, f"{field}:", "more than the")
    assert json_error(result, 2)["field"] == field
    assert not (tmp_path / "runs").exists()  # nothing was written


def make_plugin(root: Path, name: str, body: str) -> Path:
    """An 'installed' plugin: a fake dist-info with a `speedtronic` entry point, and its module."""
    site = root / "site"
    dist_info = site / f"{name}-0.0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[speedtronic]\n{name} = {name}_mod\n")
    (site / f"{name}_mod.py").write_text(body)
    return site


@pytest.mark.parametrize(
    ("body", "hook"),
    [
        ("import sys\nsys.exit(3)\n", "failed to load (called sys.exit(3))"),
        (
            "from speedtronic import hookimpl\n\n@hookimpl\ndef register_models(register):\n"
            "    raise RuntimeError('no models today')\n",
            "failed in register_models (RuntimeError: no models today)",
        ),
        (
            "from speedtronic import hookimpl\n\n@hookimpl\ndef register_hooks(register):\n    raise SystemExit(4)\n",
            "failed in register_hooks (called sys.exit(4))",
        ),
    ],
)
def test_a_failing_plugin_is_a_warning_naming_it_and_the_hook(
    run_cli: Callable[..., Any], tmp_path: Path, body: str, hook: str
) -> None:
    site = make_plugin(tmp_path, "badplug", body)
    result = run_cli(
        "plugins", "--json", env={"PYTHONPATH": f"{SRC_DIR}:{site}", "SPEEDTRONIC_LOAD_PLUGINS": "badplug"}
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning:" in line]
    assert any("'badplug'" in line and hook in line for line in warnings), result.stderr
    assert isinstance(json.loads(result.stdout.strip().splitlines()[-1])["plugins"], list)


def prepared(run_cli: Callable[..., Any], tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    out = tmp_path / "ds"
    assert run_cli("data", "prepare", corpus, "--out", out).returncode == 0
    return out


def train_on(run_cli: Callable[..., Any], config_file: Path, dataset: Path) -> Any:
    """`speedtronic train` of the fault config on a prepared dataset (its vocabulary from the data)."""
    return run_cli(
        "train",
        config_file,
        "--set",
        f"data.dataset={dataset}",
        "--set",
        "data.synthetic=false",
        "--set",
        "data.vocab_size=null",
    )


def test_prepared_ids_past_the_vocabulary_are_a_data_error(
    run_cli: Callable[..., Any], tmp_path: Path, config_file: Path
) -> None:
    dataset = prepared(run_cli, tmp_path)
    meta = json.loads((dataset / "meta.json").read_text())
    shard = dataset / meta["shards"]["train"][0]["file"]
    size = shard.stat().st_size  # every id far past the byte tokenizer's vocabulary
    shard.write_bytes((65000).to_bytes(2, "little") * (size // 2))
    result = train_on(run_cli, config_file, dataset)
    one_error_line(
        result, 1, "token id 65,000", "outside the vocabulary", "re-run `speedtronic data prepare`"
    )
    assert not (tmp_path / "runs" / "f" / "checkpoints").exists()


def test_a_wrong_meta_dtype_is_a_data_error(
    run_cli: Callable[..., Any], tmp_path: Path, config_file: Path
) -> None:
    dataset = prepared(run_cli, tmp_path)
    meta = json.loads((dataset / "meta.json").read_text())
    assert meta["dtype"] == "uint16"
    # uint16 files described as uint32 with halved counts: consistent sizes, nonsense ids.
    meta["dtype"] = "uint32"
    for split in ("train", "val"):
        for shard in meta["shards"][split]:
            shard["tokens"] //= 2
            (dataset / shard["file"]).write_bytes(
                (dataset / shard["file"]).read_bytes()[: shard["tokens"] * 4]
            )
        meta[f"{split}_tokens"] = sum(s["tokens"] for s in meta["shards"][split])
    (dataset / "meta.json").write_text(json.dumps(meta))
    result = train_on(run_cli, config_file, dataset)
    one_error_line(result, 1, "outside the vocabulary", "wrong dtype")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (
            ["worker", "CONFIG", "--repo", "file://bus", "--node-id", "../../evil"],
            "--node-id: invalid node id",
        ),
        (["sample", "nowhere", "--json"], "does not exist"),
        (["export", "CKPT", "full", "--format", "hf"], "already exists and is not empty"),
    ],
)
def test_usage_mistakes_exit_2(
    run_cli: Callable[..., Any], tmp_path: Path, config_file: Path, argv: list[str], fragment: str
) -> None:
    if "CKPT" in argv:
        assert run_cli("train", config_file, "--max-steps", "2").returncode == 0
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    args = [
        str(config_file) if a == "CONFIG" else str(tmp_path / "runs/f/checkpoints") if a == "CKPT" else a
        for a in argv
    ]
    result = run_cli(*args)
    one_error_line(result, 2, fragment)
    if "--json" in argv:
        assert json_error(result, 2)
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "bus").exists()


def test_a_read_only_checkpoint_directory_names_the_real_field(
    run_cli: Callable[..., Any], tmp_path: Path, config_file: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    result = run_cli(
        "train",
        config_file,
        "--set",
        f"checkpoint.directory={blocker / 'checkpoints'}",
        "--max-steps",
        "2",
        "--json",
    )
    one_error_line(result, 1, "could not write checkpoint", "checkpoint.directory is a writable directory")
    assert json_error(result, 1)
    assert blocker.read_text() == ""


@pytest.mark.parametrize("delay", [0.6, 1.5])
def test_sigterm_during_start_up_exits_130(tmp_path: Path, config_file: Path, delay: float) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(SRC_DIR)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "train", str(config_file), "--json"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)  # importing torch, building the app: before any training loop runs
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    finished = '"steps"' in stdout  # the run's result: it ended before the signal arrived
    if proc.returncode == 0 or (finished and proc.returncode == -signal.SIGTERM):
        # A very fast machine: the run was over, or the process was already tearing down (its
        # handlers gone), when the signal came.
        pytest.skip("the run finished before the signal arrived")
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    last = json.loads(stdout.strip().splitlines()[-1])  # an error object, or a run stopped gracefully
    assert last.get("exit_code") == 130 or last.get("interrupted") is True, last
