"""The run plan (speedtronic/plan.py) and what rests on it: an immutable config, `--max-steps` within the
run, one checkpoint layout, one way back from a checkpoint, the Sync seam and the composable Trainer.

Each reproduction from the issue that introduced the plan runs here through the real CLI."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_tokenizers import make_hf_tokenizer
from speedtronic import Trainer, load_config
from speedtronic.engine.build import build_model
from speedtronic.engine.checkpoint import files as ckpt_files
from speedtronic.errors import ConfigError
from speedtronic.plan import DataFacts, DeviceFacts, plan_run, replan

pytestmark = pytest.mark.usefixtures("isolated_env")

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"
SHAKESPEARE = REPO / "configs" / "shakespeare.yaml"
SRC = REPO / "src"
TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "data.block_size=32",
    "data.micro_batch_size=2",
]


def last_json(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def cpu_plan(config: Any, **kwargs: Any) -> Any:
    return plan_run(config, data=DataFacts(256), device=DeviceFacts("cpu"), **kwargs)


# ------------------------------------------------------------------------------------ the plan itself


def test_the_config_is_immutable_and_the_plan_derives() -> None:
    config = load_config(SMOKE)
    with pytest.raises(Exception, match="frozen"):
        config.run.max_steps = 5  # type: ignore[misc]
    plan = cpu_plan(config, world_size=2)
    assert (plan.global_batch_size, plan.accum_steps) == (16, 1)  # one micro-batch per rank by default
    assert config.data.target_batch_size is None  # nothing was written back
    longer = replan(plan, config, start_step=10, stop_step=20)
    assert (longer.start_step, longer.stop_step, longer.steps_to_run, longer.total_steps) == (10, 20, 10, 30)


def test_max_steps_past_the_end_of_the_run_is_a_config_error() -> None:
    config = load_config(SMOKE, ["run.max_steps=20"])
    with pytest.raises(ConfigError, match=r"run\.max_steps is 20\. ") as info:
        cpu_plan(config, stop_step=21)
    assert info.value.exit_code == 2
    assert cpu_plan(config, stop_step=20).stop_step == 20


# --------------------------------------------------------------------------------------- validate


def test_validate_output_fed_back_gives_the_same_plan(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    """The printed config (with the plan as comments) is itself a config: on 2 ranks and with a new run
    length it plans exactly as the original does (before the plan, the fed-back file failed on 2 ranks
    and kept the old schedule)."""
    printed = run_cli("validate", SMOKE)
    assert printed.returncode == 0, printed.stderr
    assert "# --- run plan" in printed.stdout
    copy = tmp_path / "printed.yaml"
    copy.write_text(printed.stdout)
    for extra in (
        ["--nproc", "2"],
        ["--set", "run.max_steps=2000"],
        ["--nproc", "2", "--set", "run.max_steps=2000"],
    ):
        original = run_cli("validate", SMOKE, "--json", *extra)
        fed_back = run_cli("validate", copy, "--json", *extra)
        assert original.returncode == fed_back.returncode == 0, fed_back.stderr
        assert last_json(fed_back.stdout)["plan"] == last_json(original.stdout)["plan"]
    longer = last_json(
        run_cli("validate", copy, "--json", "--nproc", "2", "--set", "run.max_steps=2000").stdout
    )
    assert longer["plan"]["schedule_steps"] == 2000 and longer["plan"]["warmup_steps"] == 100
    assert longer["plan"]["global_batch_size"] == 16 and longer["plan"]["world_size"] == 2


@pytest.mark.slow
def test_validate_output_trains_on_two_ranks(run_cli: Callable[..., Any], tmp_path: Path) -> None:
    printed = run_cli("validate", SMOKE, "--set", "run.max_steps=3", *(f"--set={s}" for s in TINY))
    (tmp_path / "printed.yaml").write_text(printed.stdout)
    result = run_cli(
        "train", "printed.yaml", "--nproc", "2", "--json", "--set", f"run.output_dir={tmp_path}/out"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = last_json(result.stdout)
    assert summary["steps"] == 3 and summary["plan"]["world_size"] == 2
    assert summary["tokens"] == 3 * summary["plan"]["global_batch_size"] * 32


# ------------------------------------------------------------------------------------- --max-steps


def test_max_steps_40_of_600_is_not_compiled_and_counts_to_40(
    run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    sets = [f"--set={s}" for s in [*TINY, "run.log_every=20", "run.eval_every=0", "data.val_batches=1"]]
    result = run_cli(
        "train", SHAKESPEARE, "--max-steps", "40", "--json", *sets, "--set", f"run.output_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = last_json(result.stdout)
    assert summary["steps"] == 40 and summary["plan"]["total_steps"] == 600
    assert summary["compiled"] is False
    reason = "auto: 40 steps to run is under compile.auto_min_steps=100"
    assert summary["compile_reason"] == reason and reason in result.stderr  # the start-up summary says why
    assert "step 40/40" in result.stderr and "/600" not in result.stderr  # the progress total is this run's
    assert summary["plan"]["schedule_steps"] == 600  # the schedule still follows the whole run


def test_max_steps_past_the_end_exits_2_naming_run_max_steps(
    run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    result = run_cli("train", SMOKE, "--max-steps", "100", "--set", f"run.output_dir={tmp_path}")
    assert result.returncode == 2
    assert "run.max_steps is 30" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists()  # refused before anything ran


def test_train_with_distributed_enabled_never_trains_alone(
    run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    result = run_cli(
        "train", SMOKE, "--set", "distributed.enabled=true", "--set", f"run.output_dir={tmp_path}"
    )
    assert result.returncode == 2
    assert "speedtronic master" in result.stderr and "speedtronic worker" in result.stderr
    assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------------------------- one way back from a checkpoint


def test_a_prepared_dataset_run_samples_exports_and_inspects_with_its_vocabulary(
    run_cli: Callable[..., Any], tmp_path: Path
) -> None:
    """sample used to rebuild the model with a 256 vocabulary for a 280-token dataset and fail."""
    from speedtronic.engine.data.text import read_default_corpus_bytes

    corpus = read_default_corpus_bytes()[:200_000].decode()
    tok = make_hf_tokenizer(
        tmp_path / "tok.json", corpus, vocab_size=280, special_tokens=(), split_newlines=False
    )
    (tmp_path / "corpus.txt").write_bytes(read_default_corpus_bytes()[:60_000])
    prepared = run_cli("data", "prepare", "corpus.txt", "--tokenizer", tok, "--out", "ds")
    assert prepared.returncode == 0, prepared.stderr
    sets = [f"--set={s}" for s in [*TINY, "run.max_steps=3", "run.eval_every=0", "data.dataset=ds"]]
    trained = run_cli(
        "train", SMOKE, "--json", *sets, "--set=data.synthetic=false", "--set=data.vocab_size=null"
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert last_json(trained.stdout)["plan"]["vocab_size"] == 280
    checkpoints = "runs/smoke/checkpoints"

    sampled = run_cli("sample", checkpoints, "--prompt", "ROMEO:", "-n", "5", "--json")
    assert sampled.returncode == 0, sampled.stderr
    assert isinstance(last_json(sampled.stdout)["text"], str)
    inspected = last_json(run_cli("checkpoint", "inspect", checkpoints, "--json").stdout)
    assert inspected["vocab_size"] == 280 and inspected["plan"]["tokenizer"] == str(tok)
    assert inspected["parameter_count"] > 0 and inspected["format"] == ckpt_files.CHECKPOINT_FORMAT
    exported = run_cli("export", checkpoints, "hf", "--json")
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 280


# ------------------------------------------------------------------------------ the Python API


def small_config(tmp_path: Path, *extra: str) -> Any:
    return load_config(
        SMOKE,
        [
            "run.max_steps=6",
            "run.log_every=1",
            "run.eval_every=0",
            f"run.output_dir={tmp_path}",
            "checkpoint.every_steps=3",
            "precision.mode=fp32",
            "compile.enabled=false",
            "logging.hooks=[]",
            "model.n_layer=1",
            "model.d_model=32",
            "data.micro_batch_size=4",
            "data.block_size=16",
            *extra,
        ],
    )


class CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure: Any = None) -> Any:
        type(self).steps += 1
        return super().step(closure)


def user_parts(config: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = build_model(config, 256)
    optimizer = CountingSGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
    return model, optimizer, scheduler


def test_a_users_optimizer_and_scheduler_are_stepped_checkpointed_and_resumed_bitwise(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, optimizer, scheduler = user_parts(small_config(tmp_path / "a"))
    CountingSGD.steps = 0
    whole = Trainer(
        small_config(tmp_path / "a"), model=model, optimizer=optimizer, scheduler=scheduler, progress=False
    )
    assert whole.optimizer is optimizer and whole.scheduler is scheduler  # used as given
    result = whole.train()
    assert CountingSGD.steps == 6 and scheduler.last_epoch == 6  # the user's objects were stepped
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * 0.8**6)
    assert result.optimizer == "CountingSGD"

    torch.manual_seed(0)
    config = small_config(tmp_path / "b")
    m, o, s = user_parts(config)
    Trainer(config, model=m, optimizer=o, scheduler=s, progress=False).train(max_steps=3)
    m, o, s = user_parts(config)  # fresh objects: everything they hold now comes from the checkpoint
    resumed = Trainer(config, model=m, optimizer=o, scheduler=s, progress=False)
    assert resumed.step == 3 and s.last_epoch == 3 and o.state  # schedule position, momentum restored
    assert resumed.train().final_loss == result.final_loss
    for (name, a), b in zip(model.state_dict().items(), m.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_format_1_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    """Checkpoints of the previous release (the flat 17-key dict) still resume, bitwise."""
    reference = Trainer(small_config(tmp_path / "a"), progress=False).train()
    config = small_config(tmp_path / "b")
    Trainer(config, progress=False).train(max_steps=3)
    path = ckpt_files.latest_checkpoint(config.checkpoint_dir())
    assert path is not None
    new = ckpt_files.load_checkpoint(path)
    parts = new["parts"]
    old = {  # the previous release's writer, key by key
        "format": 1,
        "step": new["step"],
        "model": parts["model"],
        "optimizer": parts["optimizer"],
        "optimizer_name": "adamw",
        "scheduler": parts["scheduler"],
        "scheduler_name": "cosine",
        "grad_scaler": None,
        "tokens_seen": parts["counters"]["tokens_seen"],
        "batches_consumed": parts["counters"]["batches_consumed"],
        "rng": parts["rng"],
        "data_state": parts["data"],
        "config": new["config"],
        "precision": "fp32",
        "created_at": new["created_at"],
        "coordinator": None,
        "metrics": new["metrics"],
    }
    torch.save(old, path)
    resumed = Trainer(config, progress=False)
    assert resumed.resumed_from == str(path) and resumed.step == 3
    assert resumed.train().final_loss == reference.final_loss


def test_the_engine_never_imports_the_cli_diloco_or_the_plugin_host() -> None:
    forbidden = ("speedtronic.cli", "speedtronic.diloco", "speedtronic.plugins")
    found = []
    for path in sorted((SRC / "speedtronic" / "engine").rglob("*.py")):
        package = ".".join(path.relative_to(SRC).with_suffix("").parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the module's own package
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            found += [f"{path.name}: {n}" for n in names if n.startswith(forbidden)]
    assert found == []


def test_the_public_api_is_lazy(run_cli: Callable[..., Any]) -> None:
    code = (
        "import sys, speedtronic\n"
        "print(sorted(m for m in sys.modules if m == 'torch'))\n"
        "from speedtronic import RunPlan, Sync, Trainer, load_run, plan_run\n"
        "print(Trainer.__module__, RunPlan.__module__, load_run.__module__)\n"
    )
    result = run_cli(python_code=code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "[]"
    assert lines[1] == "speedtronic.api speedtronic.plan speedtronic.engine.checkpoint.load_run"


def test_sync_protocol_is_what_the_diloco_coordinator_implements() -> None:
    from speedtronic import Sync
    from speedtronic.diloco.worker import Coordinator

    for method in ("attach", "after_step", "state_dict", "load_state_dict", "close"):
        assert callable(getattr(Coordinator, method))
    assert issubclass(Coordinator, Sync)
