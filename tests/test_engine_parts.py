"""Engine components: precision plans, LR schedules, compile fallback, gradient checkpointing, hooks."""

from __future__ import annotations

import builtins
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from speedtronic import Trainer, hardware
from speedtronic.builtin.hooks import JsonlHook, TensorBoardHook
from speedtronic.config import load_config
from speedtronic.engine.build import build_model, set_gradient_checkpointing
from speedtronic.engine.events import EventBus
from speedtronic.engine.metrics import Throughput
from speedtronic.engine.precision import plan_precision
from speedtronic.engine.schedule import lr_multiplier
from speedtronic.engine.step_fn import FiniteWatch, ensure_train_mode
from speedtronic.errors import ConfigError

CPU = torch.device("cpu")


def small(tmp_path: Path, **sections: Any) -> Any:
    base: dict[str, Any] = {
        "run": {"max_steps": 4, "log_every": 1, "eval_every": 0, "output_dir": str(tmp_path)},
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32},
        "data": {
            "synthetic": True,
            "vocab_size": 64,
            "num_tokens": 5000,
            "block_size": 16,
            "micro_batch_size": 2,
            "val_batches": 1,
        },
        "checkpoint": {"enabled": False},
        "logging": {"hooks": []},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            base.setdefault(name, {}).update(values)
        else:
            base[name] = values
    return load_config(base)


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_on_cpu_follows_native_bf16(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr("speedtronic.engine.device.cpu_has_native_bf16", lambda: native)
    plan = plan_precision("auto", "float32", CPU)
    assert plan.mode == ("bf16" if native else "fp32")
    assert plan.autocast_dtype == (torch.bfloat16 if native else None)
    assert not plan.use_grad_scaler and not plan.warnings


def test_explicit_modes_on_cpu() -> None:
    bf16 = plan_precision("bf16", "float32", CPU)
    assert bf16.mode == "bf16" and bf16.autocast_dtype == torch.bfloat16  # runs, if emulated
    fp16 = plan_precision("fp16", "float32", CPU)
    assert fp16.mode == "fp32" and fp16.autocast_dtype is None and "falling back to fp32" in fp16.warnings[0]
    pure = plan_precision("bf16", "bfloat16", CPU)
    assert pure.param_dtype == torch.bfloat16 and pure.autocast_dtype is None


def test_cpu_bf16_flags_are_read_from_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hardware.CPU_BF16_ENV, raising=False)  # not forced: read the flags
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16"}))
    assert hardware.cpu_has_native_bf16()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not hardware.cpu_has_native_bf16()


def test_bf16_autocast_training_runs_on_cpu(tmp_path: Path) -> None:
    result = Trainer(small(tmp_path, precision={"mode": "bf16"}), progress=False).train()
    assert result.precision == "bf16" and math.isfinite(result.final_loss)


@pytest.mark.parametrize("name", ["cosine", "linear", "constant"])
def test_schedule_shapes(name: str) -> None:
    factor = lr_multiplier(name, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0)
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[name]
    assert factor(110) == pytest.approx(end) and factor(500) == pytest.approx(end)
    middle = {"cosine": 0.55, "linear": 0.55, "constant": 1.0}[name]
    assert factor(60) == pytest.approx(middle)
    values = [factor(s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


@pytest.mark.parametrize("fail_at", [1, 3])
def test_compile_failure_falls_back_to_eager_at_any_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fail_at: int
) -> None:
    """A compiled step that fails — the first compilation, or a recompilation at a later step — logs a
    warning and the run continues eagerly from that very step, with the same batches and RNG: the
    loss curve is the eager run's, bitwise."""

    class FailsOnCall(nn.Module):
        """Stands in for a compiled module whose compilation fails on call `fail_at`."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == fail_at:
                raise RuntimeError("inductor exploded")
            return self.inner(*args, **kwargs)

    class Losses:
        def __init__(self) -> None:
            self.values: list[float] = []

        def on_step(self, payload: dict[str, Any]) -> None:
            self.values.append(payload["loss"])

    monkeypatch.setattr(torch, "compile", lambda model, **kw: FailsOnCall(model))
    eager = Losses()
    reference = Trainer(small(tmp_path / "eager", run={"log_every": 1}), hooks={"l": eager}, progress=False)
    reference.train()
    compiled = Losses()
    config = small(tmp_path / "compiled", compile={"enabled": True}, run={"log_every": 1})
    trainer = Trainer(config, hooks={"l": compiled}, progress=False)
    assert trainer.plan.compile and trainer.plan.compile_reason == "requested"
    result = trainer.train()
    assert not result.compiled and f"torch.compile failed at step {fail_at}" in caplog.text
    assert result.compile_reason == f"torch.compile failed at step {fail_at}: trained eagerly from there"
    assert compiled.values == eager.values and len(eager.values) == result.steps  # nothing lost
    assert result.tokens == reference.tokens_seen


def test_compile_time_is_reported_apart_from_throughput(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class SlowFirstCall(nn.Module):
        """Stands in for a compiled module: the first call is slow, as compilation is."""

        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.calls = inner, 0

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                time.sleep(0.5)
            return self.inner(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", lambda model, **kw: SlowFirstCall(model))
    metered: list[int] = []
    monkeypatch.setattr(Throughput, "add", lambda self, tokens: metered.append(tokens))
    result = Trainer(small(tmp_path, compile={"enabled": True}), progress=False).train()
    assert result.compiled and result.compile_s is not None and result.compile_s >= 0.5
    # The first (compiling) step is kept out of the throughput meter; the others are all in it.
    assert (
        len(metered) == result.steps - 1
        and sum(metered) == result.tokens * (result.steps - 1) // result.steps
    )


def test_evaluating_a_compiled_run_compiles_no_other_graph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evaluation runs through the eager module: a compiled forward under no_grad and eval() would be
    another graph (the recompile `GLOBAL_STATE changed: grad_mode`), tens of seconds of inductor on
    a CPU. Real dynamo here, with its eager backend so the test does not wait on inductor."""
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend="eager", **kw))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    config = small(tmp_path, compile={"enabled": True}, run={"max_steps": 3, "eval_every": 1})
    result = Trainer(config, progress=False).train()  # an evaluation after each step
    assert result.compiled and result.steps == 3 and result.val_loss is not None
    # One frame converted, into one graph: the training step's (the eval would add a second).
    assert (counters["frames"]["total"], counters["stats"]["unique_graphs"]) == (1, 1)
    torch._dynamo.reset()


def test_ensure_train_mode_leaves_every_module_training() -> None:
    """The step's cheap `model.train()`: whichever module was put in eval mode — the whole model, a
    submodule, the module under a compiled wrapper — every one is training afterwards."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.1)))
    wrapped = torch.compile(model, backend="eager")
    for turn_off in (model, model[1][0], model[1]):
        for target in (model, wrapped):
            turn_off.eval()
            ensure_train_mode(target)
            assert all(module.training for module in target.modules())
    ensure_train_mode(model)  # all training already: nothing to do
    assert all(module.training for module in model.modules())


def test_gradient_checkpointing_from_config(tmp_path: Path) -> None:
    config = small(tmp_path, model={"gradient_checkpointing": True})
    model = build_model(config, 64)
    assert model.config.gradient_checkpointing
    root = small(tmp_path, gradient_checkpointing=True)  # the root-level shorthand
    assert not root.model.gradient_checkpointing  # the config stays as written …
    assert build_model(root, 64).config.gradient_checkpointing  # … and the built model honours it

    class Plain(nn.Module):
        pass

    assert set_gradient_checkpointing(Plain(), True) == 0


def test_jsonl_hook_appends_events(tmp_path: Path) -> None:
    hook = JsonlHook(tmp_path / "m" / "metrics.jsonl")
    hook.on_step({"step": 1, "loss": 2.5})
    hook.on_eval({"step": 1, "val_loss": 2.0, "val_ppl": 7.39})
    hook.close()
    lines = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"event": "step", "step": 1, "loss": 2.5},
        {"event": "eval", "step": 1, "val_loss": 2.0, "val_ppl": 7.39},
    ]


def test_missing_tensorboard_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_tensorboard(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("torch.utils.tensorboard") or name == "tensorboard":
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ConfigError, match=r"speedtronic-lm\[tensorboard\]"):
        TensorBoardHook(tmp_path)


def test_tensorboard_hook_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    hook = TensorBoardHook(tmp_path / "tb")
    hook.on_step({"step": 1, "loss": 2.5, "lr": 1e-3})
    hook.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_broken_hook_is_disabled_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        calls = 0

        def on_step(self, payload: dict[str, Any]) -> None:
            Broken.calls += 1
            raise OSError("disk full")

    bus = EventBus({"broken": Broken()})
    bus.emit("step", {"step": 1})
    bus.emit("step", {"step": 2})
    assert Broken.calls == 1 and "broken" not in bus.hooks and "disk full" in caplog.text
    result = Trainer(small(tmp_path), progress=False, hooks={"broken": Broken()}).train()
    assert result.steps == 4


def test_unknown_hook_and_model_names_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"logging.hooks: unknown hook 'jsnl'; did you mean 'jsonl'"):
        Trainer(small(tmp_path, logging={"hooks": ["jsnl"]}), progress=False)
    with pytest.raises(ConfigError, match=r"model.name: unknown model"):
        Trainer(small(tmp_path, model={"name": "nope"}), progress=False)


def test_wandb_hook_runs_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # Never phones home: no key a developer stored (~/.netrc, W&B's settings) is found, so the hook
    # picks offline; and W&B's server is a closed loopback port, should anything try.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))
    result = Trainer(small(tmp_path, logging={"hooks": ["wandb"]}), progress=False).train()
    assert result.steps == 4
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))


# ------------------------------------------------------------------------------- compile: auto


@pytest.mark.parametrize(
    ("device", "mode", "native_bf16", "sections", "enabled", "reason"),
    [
        ("cpu", "auto", False, {}, False, "fp32 on CPU gains too little"),
        ("cpu", "auto", True, {}, True, "CPU with native bf16"),
        ("cpu", "bf16", True, {}, True, "CPU with native bf16"),
        ("cpu", "bf16", False, {}, False, "bf16 on CPU gains too little"),  # emulated bf16
        ("cuda", "auto", False, {}, True, "CUDA"),
        ("mps", "auto", False, {}, False, "not on mps"),
        ("cuda", "auto", False, {"run": {"max_steps": 99}}, False, "99 steps to run is under"),
        ("cuda", "auto", False, {"compile": {"auto_min_steps": 0}, "run": {"max_steps": 1}}, True, "CUDA"),
        ("cuda", "auto", False, {"ooo_backprop": True}, False, "ooo_backprop is on"),
        ("cpu", "auto", False, {"compile": True}, True, "requested"),
        ("cuda", "auto", False, {"compile": False}, False, "requested"),
    ],
)
def test_compile_auto_decides_by_device_precision_and_run_length(
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    mode: str,
    native_bf16: bool,
    sections: dict[str, Any],
    enabled: bool,
    reason: str,
) -> None:
    from speedtronic.plan import DataFacts, DeviceFacts, plan_run

    config = load_config({"run": {"max_steps": 1000}, "precision": {"mode": mode}, **sections})
    plan = plan_run(config, data=DataFacts(256), device=DeviceFacts(device, native_bf16=native_bf16))
    assert plan.compile is enabled and reason in plan.compile_reason


def test_compile_auto_counts_the_steps_left_after_a_resume_or_before_max_steps() -> None:
    from speedtronic.plan import DataFacts, DeviceFacts, plan_run, replan

    config = load_config({"run": {"max_steps": 1000}})
    cuda = DeviceFacts("cuda", native_bf16=True)
    assert plan_run(config, data=DataFacts(256), device=cuda, start_step=900).compile
    late = plan_run(config, data=DataFacts(256), device=cuda, start_step=960)  # 40 steps left
    assert not late.compile and "40 steps to run is under" in late.compile_reason
    early_stop = replan(plan_run(config, data=DataFacts(256), device=cuda), config, stop_step=40)
    assert not early_stop.compile and "40 steps to run is under" in early_stop.compile_reason


def test_compile_auto_is_the_default_and_reported(tmp_path: Path) -> None:
    """A short CPU run stays eager under the default `auto`, and says why in its result."""
    assert load_config({}).compile.enabled == "auto"
    assert load_config({"compile": "auto"}, ["compile.auto_min_steps=5"]).compile.auto_min_steps == 5
    trainer = Trainer(small(tmp_path), progress=False)
    assert (
        "torch.compile off (auto: 4 steps to run is under compile.auto_min_steps=100)"
        in trainer.summary_lines()[1]
    )
    result = trainer.train()
    assert (
        not result.compiled
        and result.compile_reason == "auto: 4 steps to run is under compile.auto_min_steps=100"
    )


def test_finite_watch_names_the_first_non_finite_step_across_folds() -> None:
    watch = FiniteWatch(torch.device("cpu"))
    for step in range(1, 100):
        watch.note(step, torch.tensor(1.0))
    assert int(watch.first_bad()) == 0
    losses = {150: float("nan"), 151: float("inf"), 160: float("nan")}
    for step in range(100, 200):  # 150 falls in the middle of a fold of FOLD held losses
        watch.note(step, torch.tensor(losses.get(step, 2.0)))
    assert int(watch.first_bad()) == 150
    for step in range(200, 210):  # a later bad step does not move it
        watch.note(step, torch.tensor(float("-inf")))
    assert int(watch.first_bad()) == 150
    # Steps that are not consecutive (a new train() call) fold what was held first.
    other = FiniteWatch(torch.device("cpu"))
    other.note(1, torch.tensor(1.0))
    other.note(5, torch.tensor(float("nan")))
    other.note(6, torch.tensor(float("nan")))
    assert int(other.first_bad()) == 5
