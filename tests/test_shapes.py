"""Shape validation: expected codes and valid suggestions under an explicit cuda/bf16 profile (no GPU
needed), quiet on CPU unless asked, constraints kept, plugin models read from their modules, the CLI
(--json and the table), and the trainer's one-line-per-warning startup log."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from speedtronic import installed_registries
from speedtronic.cli.app import build_app
from speedtronic.config import load_config
from speedtronic.engine.preflight import shapes
from speedtronic.engine.preflight.shapes import apply_override, check_config, check_model, resolve_profile

REPO = Path(__file__).resolve().parents[1]

# Every dimension is off by design: head dim 34, d_model 204, d_ff 500, vocab 1000, block 100,
# micro batch 3 (3 × 100 rows), target 12 = 3 × 4 accumulation.
MISALIGNED: dict[str, Any] = {
    "run": {"name": "misaligned", "max_steps": 5},
    "model": {"n_layer": 2, "n_head": 6, "d_model": 204, "d_ff": 500},
    "data": {
        "synthetic": True,
        "vocab_size": 1000,
        "num_tokens": 10_000,
        "block_size": 100,
        "micro_batch_size": 3,
        "target_batch_size": 12,
    },
}
EXPECTED = {
    ("SHAPE_SEQUENCE", "data.block_size"),
    ("SHAPE_BATCH", "data.micro_batch_size"),
    ("SHAPE_VOCAB", "model.vocab_size"),
    ("SHAPE_HIDDEN", "model.d_model"),
    ("SHAPE_FFN", "model.d_ff"),
    ("SHAPE_HEAD_DIM", "model.n_head"),
}


def config(base: dict[str, Any] = MISALIGNED, *overrides: str) -> Any:
    return load_config(base, overrides)


def keys(warnings: list[shapes.ShapeWarning]) -> set[tuple[str, str]]:
    return {w.key for w in warnings}


def test_misaligned_config_under_cuda_bf16_gives_codes_and_valid_suggestions() -> None:
    cfg = config()
    profile, warnings = check_config(cfg, device="cuda", precision="bf16")
    assert (profile.device, profile.precision, profile.alignment, profile.vocab_alignment) == (
        "cuda",
        "bf16",
        8,
        64,
    )
    assert keys(warnings) == EXPECTED
    assert len(warnings) == len(EXPECTED)  # de-duplicated: d_model is in ~30 module dims, warned once
    by_code = {w.code: w for w in warnings}
    assert len(by_code["SHAPE_HIDDEN"].where) > 10
    assert by_code["SHAPE_VOCAB"].suggested == 1024 and by_code["SHAPE_VOCAB"].alignment == 64
    assert by_code["SHAPE_BATCH"].suggested is not None and 12 % by_code["SHAPE_BATCH"].suggested == 0
    # No n_head makes 204 / n_head a multiple of 8: the head-dim warning points at the d_model fix.
    assert by_code["SHAPE_HEAD_DIM"].suggested is None and "model.d_model" in by_code["SHAPE_HEAD_DIM"].reason
    for warning in warnings:
        if warning.code == "SHAPE_HEAD_DIM":
            continue
        assert warning.suggested is not None, warning
        fixed = apply_override(cfg, warning.field, warning.suggested)  # re-validates: must not raise
        _, after = check_config(fixed, device="cuda", precision="bf16", suggest=False)
        assert warning.key not in keys(after), warning
        assert keys(after) <= keys(warnings), (warning, keys(after) - keys(warnings))
    assert by_code["SHAPE_HIDDEN"].suggested == 192  # 192 / 6 heads = 32: it fixes the head dim too
    assert ("SHAPE_HEAD_DIM", "model.n_head") not in keys(
        check_config(
            apply_override(cfg, "model.d_model", 192), device="cuda", precision="bf16", suggest=False
        )[1]
    )


def test_head_dim_is_fixed_through_n_head_when_d_model_allows() -> None:
    cfg = config({"model": {"n_head": 8, "d_model": 240}, "data": {"block_size": 128}})
    _, warnings = check_config(cfg, device="cuda", precision="bf16")
    (head,) = warnings
    # The value is n_head's own (8), which --set model.n_head=SUGGESTED replaces; the head dim (30) is
    # in the reason. (It used to report 30 as n_head's value.)
    assert (head.code, head.field, head.value, head.alignment) == ("SHAPE_HEAD_DIM", "model.n_head", 8, 8)
    assert "head dim 30" in head.reason
    assert head.suggested == 6  # 240 / 6 = 40; 10 heads (24) is as near, fewer heads wins the tie
    assert check_config(apply_override(cfg, "model.n_head", 6), device="cuda", precision="bf16")[1] == []


def test_all_suggestions_together_give_a_clean_config() -> None:
    cfg = config()
    _, warnings = check_config(cfg, device="cuda", precision="bf16")
    fixed = config(MISALIGNED, *(f"{w.field}={w.suggested}" for w in warnings if w.suggested is not None))
    assert check_config(fixed, device="cuda", precision="bf16", suggest=False)[1] == []


def test_quiet_on_cpu_by_default_and_loud_when_asked() -> None:
    profile, warnings = check_config(config(), device="cpu")
    assert not profile.active and warnings == []
    profile, warnings = check_config(config(MISALIGNED, "shape_validation.warn_on_cpu=true"), device="cpu")
    assert profile.active and profile.alignment == 8
    assert ("SHAPE_SEQUENCE", "data.block_size") in keys(warnings)
    profile, warnings = check_config(config(MISALIGNED, "shape_validation.alignment=4"), device="cpu")
    assert profile.active and {w.alignment for w in warnings} == {4}
    (head,) = warnings  # of all the dims only head dim 34 is not a multiple of 4
    assert (head.code, head.suggested) == ("SHAPE_HEAD_DIM", 3)  # 204 / 3 heads = 68
    disabled = config(MISALIGNED, "shape_validation.enabled=false")
    assert check_config(disabled, device="cuda", precision="bf16")[1] == []


def test_check_switches_turn_off_their_checks() -> None:
    off = [f"shape_validation.check_{name}=false" for name in ("batch", "sequence", "vocab", "model")]
    assert check_config(config(MISALIGNED, *off), device="cuda", precision="bf16")[1] == []
    _, only_vocab = check_config(config(MISALIGNED, *off[:2], off[3]), device="cuda", precision="bf16")
    assert keys(only_vocab) == {("SHAPE_VOCAB", "model.vocab_size")}


def test_no_suggestion_rather_than_one_that_breaks_the_target_batch() -> None:
    # 3 × 100 rows need an even micro batch, and no even number divides the target of 9 sequences.
    cfg = config(MISALIGNED, "data.target_batch_size=9")
    _, warnings = check_config(cfg, device="cuda", precision="bf16")
    batch = next(w for w in warnings if w.code == "SHAPE_BATCH")
    assert batch.suggested is None and "alone passes" in batch.reason


def test_vocab_is_padded_up_never_below_the_tokenizer() -> None:
    # The byte tokenizer has 256 tokens: 200 would be rejected by the data layer, so pad 300 up only.
    base = {"model": {"vocab_size": 300, "n_head": 4, "d_model": 256}, "data": {"block_size": 128}}
    _, warnings = check_config(config(base), device="cuda", precision="bf16")
    (vocab,) = warnings
    assert (vocab.code, vocab.value, vocab.suggested) == ("SHAPE_VOCAB", 300, 320)
    from speedtronic.engine.build import data_facts

    assert data_facts(config(base)).vocab_size == 256


def test_hopper_profile_asks_for_64_wide_dims() -> None:
    cfg = config({"model": {"n_layer": 1, "n_head": 4, "d_model": 160}, "data": {"block_size": 128}})
    assert check_config(cfg, device="cuda", precision="bf16")[1] == []  # 160 is fine for 8
    profile, warnings = check_config(cfg, device="cuda", precision="bf16", gpu="NVIDIA H200")
    assert (profile.alignment, profile.head_alignment, profile.vocab_alignment) == (64, 8, 128)
    hidden = next(w for w in warnings if w.code == "SHAPE_HIDDEN")
    assert hidden.value == 160 and hidden.suggested in (128, 192)
    fp32 = resolve_profile(cfg, device="cuda", precision="fp32")
    assert fp32.alignment == 4


def test_plugin_model_is_read_from_its_modules() -> None:
    from speedtronic.plugins import registries

    if "example-gru" not in registries().models.names():
        pytest.skip("the example plugin is not installed")
    base = yaml.safe_load((REPO / "configs" / "example-plugin.yaml").read_text())
    cfg = config(base, "model.options.hidden_size=100", "shape_validation.warn_on_cpu=true")
    _, warnings = check_config(cfg, device="cpu", registries=installed_registries())
    (hidden,) = warnings
    assert (hidden.code, hidden.field, hidden.value) == ("SHAPE_DIM", "model.options.hidden_size", 100)
    assert "gru.hidden_size" in hidden.where and hidden.suggested == 104


def test_cli_json_and_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "misaligned.yaml"
    path.write_text(yaml.safe_dump(MISALIGNED))
    monkeypatch.setenv("COLUMNS", "1000")
    app, runner = build_app(with_plugins=False), CliRunner()
    result = runner.invoke(app, ["shapes", str(path), "--device", "cuda", "--precision", "bf16", "--json"])
    assert result.exit_code == 0, result.output  # warnings are advice: exit 0
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["profile"]["alignment"] == 8 and payload["profile"]["device"] == "cuda"
    assert {(w["code"], w["field"]) for w in payload["warnings"]} == EXPECTED
    assert all(
        set(w) == {"code", "field", "value", "suggested", "alignment", "reason"} for w in payload["warnings"]
    )

    result = runner.invoke(app, ["shapes", str(path), "--device", "cuda", "--set", "data.block_size=128"])
    assert result.exit_code == 0
    assert "SHAPE_VOCAB" in result.stdout and "SHAPE_SEQUENCE" not in result.stdout
    assert "│ model.vocab_size" in result.stdout and "1024" in result.stdout
    result = runner.invoke(app, ["shapes", str(path), "--gpu", "H100", "--json"])  # --gpu implies cuda
    assert json.loads(result.stdout.strip().splitlines()[-1])["profile"]["alignment"] == 64
    result = runner.invoke(app, ["shapes", str(path), "--device", "cpu", "--json"])
    assert json.loads(result.stdout.strip().splitlines()[-1])["warnings"] == []


def misaligned_run(tmp_path: Path, n_layer: int) -> dict[str, Any]:
    """A one-step synthetic run whose d_model (36) and block size (30) draw shape warnings on the CPU."""
    return {
        "run": {"max_steps": 1, "output_dir": str(tmp_path / "out")},
        "model": {"n_layer": n_layer, "n_head": 2, "d_model": 36},
        "data": {
            "synthetic": True,
            "vocab_size": 64,
            "num_tokens": 5000,
            "block_size": 30,
            "micro_batch_size": 2,
        },
        "checkpoint": {"enabled": False},
        "logging": {"hooks": []},
        "shape_validation": {"warn_on_cpu": True},
    }


def test_trainer_logs_each_warning_once_and_never_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from speedtronic import Trainer

    base = misaligned_run(tmp_path, n_layer=2)
    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        Trainer(config(base), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "speedtronic.shapes"]
    assert sum("SHAPE_HIDDEN model.d_model=36" in line for line in lines) == 1
    assert any(line.startswith("SHAPE_SEQUENCE data.block_size=30") and "--set" in line for line in lines)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("checker bug")

    monkeypatch.setattr(shapes, "check_model", broken)
    Trainer(config(base), progress=False)  # shape advice must never stop a run


def test_build_run_only_builds_its_callers_advise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The shape advisory is preflight's (engine/preflight/advice.py), run by the API over the engine's
    `build_run`; the engine's own `build_run` logs none, and a run given its own model gets none."""
    from speedtronic import api
    from speedtronic.engine.run import build_run

    base = misaligned_run(tmp_path, n_layer=1)

    def advice() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if r.name == "speedtronic.shapes"]
        caplog.clear()
        return lines

    with caplog.at_level(logging.WARNING, logger="speedtronic"):
        build_run(config(base), progress=False)
        assert advice() == []
        api.build_run(config(base), progress=False)
        assert any(line.startswith("SHAPE_HIDDEN model.d_model=36") for line in advice())
        api.build_run(config(base), progress=False, model=torch.nn.Linear(36, 36))
        assert advice() == []


def test_check_model_reads_a_built_model_not_the_config() -> None:
    cfg = config(MISALIGNED)
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, 204),
        torch.nn.Linear(204, 77),
        torch.nn.Linear(77, 77),
        torch.nn.Linear(77, 204),
    )
    profile = resolve_profile(cfg, device="cuda", precision="bf16")
    warnings = check_model(cfg, model, profile, 1000, suggest=False)
    found = sorted((w.code, w.value) for w in warnings if w.field.startswith("model"))
    assert found == [("SHAPE_DIM", 77), ("SHAPE_HIDDEN", 204), ("SHAPE_VOCAB", 1000)]  # 77 warns once
    (dim,) = [w for w in warnings if w.code == "SHAPE_DIM"]
    assert dim.field == "model (1.out_features)" and len(dim.where) == 4
    assert ("SHAPE_FFN", 500) not in found  # the config says d_ff 500, but this model has no such layer
    # The config does not build this model, so re-building it with a new d_model proves nothing:
    # model fields get no suggestion; data fields still do.
    suggested = {w.code: w.suggested for w in check_model(cfg, model, profile, 1000)}
    assert suggested["SHAPE_HIDDEN"] is None and suggested["SHAPE_SEQUENCE"] == 104


class Conv1D(torch.nn.Module):
    """Stands in for transformers' GPT-2 Conv1D (recognised by class name): weight [in, out]."""

    def __init__(self, n_out: int, n_in: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n_in, n_out))


def test_conv1d_and_position_embeddings() -> None:
    cfg = config({"model": {"vocab_size": 256, "d_model": 64, "n_head": 4}, "data": {"block_size": 64}})
    # Token embedding 256 × 64, position embedding 1000 × 64 (a lookup, not a matmul), Conv1D 64 -> 90.
    model = torch.nn.ModuleDict(
        {"wte": torch.nn.Embedding(256, 64), "wpe": torch.nn.Embedding(1000, 64), "c_fc": Conv1D(90, 64)}
    )
    profile = resolve_profile(cfg, device="cuda", precision="bf16")
    (dim,) = check_model(cfg, model, profile, 256, suggest=False)
    assert (dim.code, dim.value, dim.where) == ("SHAPE_DIM", 90, ["c_fc.weight[1]"])


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_follow_the_advice(path: Path) -> None:
    from speedtronic.plugins import registries

    cfg = load_config(path)
    if cfg.model.name not in registries().models.names():
        pytest.skip(f"model {cfg.model.name} is not installed")
    for gpu in (None, "H100"):
        assert (
            check_config(
                cfg,
                device="cuda",
                precision="bf16",
                gpu=gpu,
                suggest=False,
                registries=installed_registries(),
            )[1]
            == []
        )
