"""The run config: defaults and derived values, the invalid-config matrix, aliases, `--set` overrides,
secrets handling and dump/load round trips (speedtronic.config)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from speedtronic.config import REDACTED, Config, config_to_yaml, dump_config, load_config
from speedtronic.errors import ConfigError
from speedtronic.plan import DataFacts, DeviceFacts, RunPlan, plan_run, synthetic_vocab_size

pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "smoke.yaml"


def plan(cfg: Config, world_size: int = 1, vocab: int = 256) -> RunPlan:
    return plan_run(cfg, world_size=world_size, data=DataFacts(vocab), device=DeviceFacts("cpu"))


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config_error(source: Any = None, overrides: tuple[str, ...] | list[str] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(source if source is not None else {}, overrides)
    assert info.value.exit_code == 2
    return info.value


# ------------------------------------------------------------------------------------- valid + defaults


def test_five_line_yaml_is_valid_and_derived_values_resolve(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  name: tiny\n  max_steps: 200\ndata:\n  micro_batch_size: 4\n")
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.run.name == "tiny" and cfg.run.max_steps == 200
    # The config stays as written: what is unset is derived in the plan, never written back.
    assert cfg.scheduler.warmup_steps is None
    assert cfg.model.max_seq_len is None and cfg.data.seed is None and cfg.data.target_batch_size is None
    derived = plan(cfg)
    assert derived.schedule_steps == 200  # follows run.max_steps
    assert derived.warmup_steps == 10  # 5% of 200
    assert derived.max_seq_len == cfg.data.block_size == 256
    assert derived.data_seed == cfg.run.seed == 1337
    assert derived.global_batch_size == 4 and derived.accum_steps == 1
    assert derived.log_every == cfg.run.log_every == 10
    assert cfg.output_dir() == "runs/tiny"
    assert cfg.checkpoint_dir() == "runs/tiny/checkpoints"
    assert cfg.metrics_file() == "runs/tiny/metrics.jsonl"


def test_empty_file_and_empty_mapping_give_the_defaults(tmp_path: Path) -> None:
    from_file = load_config(write(tmp_path, "# nothing but a comment\n"))
    assert from_file == load_config({}) == load_config(None)
    assert from_file.optimizer.name == "adamw" and from_file.optimizer.lr == pytest.approx(3e-4)
    assert plan(from_file).schedule_steps == from_file.run.max_steps == 1000
    assert plan(from_file).warmup_steps == 50


def test_explicit_values_win_over_derived_defaults() -> None:
    cfg = load_config(
        {
            "run": {"max_steps": 500, "seed": 3},
            "scheduler": {"warmup_steps": 7},
            "model": {"max_seq_len": 512},
            "data": {"block_size": 128, "seed": 9, "micro_batch_size": 4, "target_batch_size": 16},
        }
    )
    derived = plan(cfg)
    assert derived.schedule_steps == 500 and derived.warmup_steps == 7
    assert derived.max_seq_len == 512 and derived.block_size == 128
    assert derived.data_seed == 9 and cfg.run.seed == 3
    assert derived.global_batch_size == 16 and derived.accum_steps == 4


def test_warmup_default_is_capped_at_1000() -> None:
    assert plan(load_config({}, ["run.max_steps=100000"])).warmup_steps == 1000
    assert plan(load_config({}, ["run.max_steps=19"])).warmup_steps == 0


def test_gradient_checkpointing_shorthand() -> None:
    cfg = load_config({}, ["run.max_steps=100", "gradient_checkpointing=true"])
    assert cfg.max_steps() == 100 and plan(cfg).total_steps == plan(cfg).schedule_steps == 100
    assert plan(cfg).gradient_checkpointing is True


@pytest.mark.parametrize("field", ["data.max_steps", "scheduler.max_steps"])
def test_the_removed_step_counts_are_errors_naming_run_max_steps(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field} was removed: .*run\.max_steps") as info:
        load_config({}, [f"{field}=40"])
    assert info.value.exit_code == 2
    # What older versions dumped for "unset" (a checkpoint's stored config) still loads.
    section, key = field.split(".")
    assert load_config({section: {key: None}}).max_steps() == 1000


@pytest.mark.parametrize("source", ["text_path: corpus.txt", "dataset: data/prepared"])
def test_synthetic_with_another_data_source_is_an_error_naming_both(source: str) -> None:
    field = source.split(":")[0]
    with pytest.raises(ConfigError, match=rf"data\.synthetic .*data\.{field}") as info:
        load_config({"data": {"synthetic": True, field: source.split(": ")[1]}})
    assert info.value.exit_code == 2


def test_text_path_and_dataset_together_are_an_error() -> None:
    with pytest.raises(ConfigError, match=r"data\.text_path and data\.dataset"):
        load_config({"data": {"text_path": "a.txt", "dataset": "prepared"}})


def test_synthetic_vocab_is_shared_between_data_and_model() -> None:
    cfg = load_config({"data": {"synthetic": True}})
    assert synthetic_vocab_size(cfg) == plan(cfg, vocab=synthetic_vocab_size(cfg)).vocab_size == 256
    cfg = load_config({"data": {"synthetic": True}, "model": {"vocab_size": 512}})
    assert synthetic_vocab_size(cfg) == plan(cfg, vocab=synthetic_vocab_size(cfg)).vocab_size == 512
    error = config_error({"data": {"synthetic": True, "vocab_size": 1000}, "model": {"vocab_size": 500}})
    assert "model.vocab_size" in str(error)


# ------------------------------------------------------------------------------------------ invalid


@pytest.mark.parametrize(
    ("overrides", "path"),
    [
        (["optimizer.lr=abc"], "optimizer.lr"),
        (["optimizer.lr=0"], "optimizer.lr"),
        (["model.n_layer=0"], "model.n_layer"),
        (["data.micro_batch_size=-4"], "data.micro_batch_size"),
        (["run.max_steps=-1"], "run.max_steps"),
        (["model.dropout=1.5"], "model.dropout"),
        (["data.val_fraction=-0.1"], "data.val_fraction"),
        (["scheduler.min_lr_ratio=2"], "scheduler.min_lr_ratio"),
        (["optimizer.betas=[1.5, 0.9]"], "optimizer.betas"),
        (["scheduler.name=exponential"], "scheduler.name"),
        (["precision.mode=fp8"], "precision.mode"),
        (["run.device=tpu"], "run.device"),
        (["run.device=cuda:x"], "run.device"),
        (["data.micro_batch_size=8", "data.target_batch_size=20"], "data.target_batch_size"),
        (["optimizer.muon_lr=0.02"], "optimizer.muon_lr"),
        (["optimizer.muon_momentum=0.5"], "optimizer.muon_momentum"),
        (["model.d_model=100", "model.n_head=3"], "model.d_model"),
        (["model.max_seq_len=128", "data.block_size=256"], "data.block_size"),
        (["scheduler.warmup_steps=2000"], "scheduler.warmup_steps"),
        (["run.max_steps=100", "scheduler.warmup_steps=101"], "scheduler.warmup_steps"),
    ],
)
def test_invalid_values_raise_config_error_naming_the_dotted_path(overrides: list[str], path: str) -> None:
    message = str(config_error({}, overrides))
    assert path in message, message
    assert message.startswith("invalid config")


def test_invalid_value_in_a_file_names_the_file_and_shows_the_value(tmp_path: Path) -> None:
    path = write(tmp_path, "optimizer:\n  lr: fast\n")
    message = str(config_error(path))
    assert str(path) in message
    assert "optimizer.lr" in message and "'fast'" in message


def test_all_problems_are_reported_at_once() -> None:
    message = str(config_error({}, ["optimizer.lr=abc", "model.n_layer=0", "run.device=tpu"]))
    for path in ("optimizer.lr", "model.n_layer", "run.device"):
        assert path in message


def test_muon_fields_are_allowed_with_a_muon_optimizer() -> None:
    cfg = load_config({}, ["optimizer.name=muon", "optimizer.muon_lr=0.02", "optimizer.muon_plus=row"])
    assert cfg.optimizer.muon_lr == pytest.approx(0.02) and cfg.optimizer.muon_plus == "row"
    assert "optimizer.muon_plus" in str(config_error({}, ["optimizer.name=muon", "optimizer.muon_plus=diag"]))


@pytest.mark.parametrize(
    ("source", "unknown", "suggestion"),
    [
        ({"optimizer": {"lrr": 0.1}}, "optimizer.lrr", "optimizer.lr"),
        ({"optimiser": {"lr": 0.1}}, "optimiser", "optimizer"),
        ({"model": {"n_layers": 2}}, "model.n_layers", "model.n_layer"),
        ({"data": {"batch_sise": 2}}, "data.batch_sise", "data.batch_size"),
        ({"batchsize": 2}, "batchsize", "batch_size"),
    ],
)
def test_unknown_key_is_an_error_with_a_did_you_mean(
    source: dict[str, Any], unknown: str, suggestion: str
) -> None:
    message = str(config_error(source))
    assert f"{unknown}: unknown key" in message
    assert f"did you mean '{suggestion}'" in message


def test_unknown_key_without_a_close_match_has_no_suggestion() -> None:
    message = str(config_error({}, ["optimizer.zzzzzz=1"]))
    assert "optimizer.zzzzzz: unknown key" in message and "did you mean" not in message


def test_bad_yaml_syntax_names_the_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  name: a\n\tmax_steps: 3\n")
    message = str(config_error(path))
    assert f"{path}:3:" in message and "YAML syntax error" in message
    path = write(tmp_path, "run: {name: x}\noptimizer:\n  lr: 0.1\n  wd: : 3\n", name="other.yaml")
    assert f"{path}:4:" in str(config_error(path))


@pytest.mark.parametrize(
    "text",
    [
        "run:\n  seed: !!int abc\n",
        "optimizer:\n  lr: !!float fast\n",
        "run:\n  name: !!timestamp tomorrow\n",
        "data:\n  shuffle: !!bool maybe\n",
        "[" * 1000,
    ],
    ids=["bad-int-tag", "bad-float-tag", "bad-timestamp-tag", "bad-bool-tag", "deep-nesting"],
)
def test_yaml_that_pyyaml_cannot_construct_is_a_config_error(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    assert str(path) in str(config_error(path))


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("42\n", "int"), ("just words\n", "str")])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, text)
    message = str(config_error(path))
    assert str(path) in message and "must be a mapping" in message and kind in message


def test_missing_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "missing.yaml"
    message = str(config_error(path))
    assert str(path) in message and "not found" in message
    assert str(tmp_path) in str(config_error(tmp_path))  # a directory is not a config file either


def test_non_string_top_level_key_is_a_config_error(tmp_path: Path) -> None:
    assert "keys must be strings" in str(config_error(write(tmp_path, "1: 2\n")))


def test_an_empty_distributed_section_with_hf_token_set_fails_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`distributed:` with every line commented out loads as None; with HF_TOKEN set that must not crash."""
    monkeypatch.setenv("HF_TOKEN", "hf_emptySectionToken12345")
    path = write(tmp_path, "run: {name: x}\ndistributed:\n  # enabled: true\n")
    try:
        cfg = load_config(path)
    except ConfigError as error:
        assert "distributed" in str(error)
    else:
        assert cfg.distributed.bus.token is not None
        assert cfg.distributed.bus.token.get_secret_value() == "hf_emptySectionToken12345"


# ------------------------------------------------------------------------------------------ aliases


def test_top_level_aliases_expand() -> None:
    cfg = load_config(
        {"batch_size": 8, "lr": 0.01, "seq_len": 32, "seed": 7, "max_steps": 50, "device": "cpu"}
    )
    assert cfg.data.micro_batch_size == 8 and plan(cfg).global_batch_size == 8
    assert cfg.optimizer.lr == pytest.approx(0.01)
    assert cfg.data.block_size == plan(cfg).max_seq_len == 32
    assert cfg.run.seed == plan(cfg).data_seed == 7
    assert cfg.run.max_steps == plan(cfg).schedule_steps == 50
    assert cfg.run.device == "cpu"
    cfg = load_config({"learning_rate": 0.2, "micro_batch_size": 2, "block_size": 16})
    assert (cfg.optimizer.lr, cfg.data.micro_batch_size, cfg.data.block_size) == (0.2, 2, 16)


def test_in_section_aliases_expand(tmp_path: Path) -> None:
    path = write(tmp_path, "data: {batch_size: 4, seq_len: 16}\noptimizer: {learning_rate: 0.1}\n")
    cfg = load_config(path)
    assert (cfg.data.micro_batch_size, cfg.data.block_size, cfg.optimizer.lr) == (4, 16, 0.1)


@pytest.mark.parametrize(
    ("override", "attribute", "expected"),
    [
        ("lr=0.02", ("optimizer", "lr"), 0.02),
        ("learning_rate=0.03", ("optimizer", "lr"), 0.03),
        ("batch_size=2", ("data", "micro_batch_size"), 2),
        ("seq_len=8", ("data", "block_size"), 8),
        ("seed=11", ("run", "seed"), 11),
        ("max_steps=77", ("run", "max_steps"), 77),
        ("device=cpu", ("run", "device"), "cpu"),
        ("data.batch_size=3", ("data", "micro_batch_size"), 3),
        ("data.seq_len=24", ("data", "block_size"), 24),
        ("optimizer.learning_rate=0.5", ("optimizer", "lr"), 0.5),
    ],
)
def test_aliases_work_as_set_keys(override: str, attribute: tuple[str, str], expected: Any) -> None:
    cfg = load_config(SMOKE, [override])
    assert getattr(getattr(cfg, attribute[0]), attribute[1]) == expected


@pytest.mark.parametrize(
    ("source", "alias", "canonical"),
    [
        ({"lr": 0.1, "optimizer": {"lr": 0.2}}, "lr", "optimizer.lr"),
        ({"optimizer": {"learning_rate": 0.1, "lr": 0.2}}, "optimizer.learning_rate", "optimizer.lr"),
        ({"batch_size": 4, "data": {"micro_batch_size": 8}}, "batch_size", "data.micro_batch_size"),
        ({"seq_len": 4, "data": {"block_size": 8}}, "seq_len", "data.block_size"),
        ({"seed": 1, "run": {"seed": 2}}, "seed", "run.seed"),
    ],
)
def test_alias_and_canonical_key_together_is_an_error(
    source: dict[str, Any], alias: str, canonical: str
) -> None:
    message = str(config_error(source))
    assert f"'{alias}'" in message and f"'{canonical}'" in message


def test_alias_conflict_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "lr: 0.1\noptimizer:\n  lr: 0.2\n")
    assert str(path) in str(config_error(path))


def test_set_alias_overrides_the_canonical_value_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "optimizer:\n  lr: 0.1\n")
    assert load_config(path, ["lr=0.5"]).optimizer.lr == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------- --set


@pytest.mark.parametrize(
    ("override", "getter", "expected"),
    [
        ("run.max_steps=50", lambda c: c.run.max_steps, 50),
        ("optimizer.lr=1.5e-3", lambda c: c.optimizer.lr, 1.5e-3),
        ("optimizer.lr=3e-4", lambda c: c.optimizer.lr, 3e-4),
        ("optimizer.grad_clip=null", lambda c: c.optimizer.grad_clip, None),
        ("data.shuffle=false", lambda c: c.data.shuffle, False),
        ("checkpoint.resume=true", lambda c: c.checkpoint.resume, True),
        ("logging.hooks=[jsonl, tensorboard]", lambda c: c.logging.hooks, ["jsonl", "tensorboard"]),
        ("optimizer.betas=[0.8, 0.99]", lambda c: c.optimizer.betas, (0.8, 0.99)),
        (
            "distributed.master.collaborators=[alice, bob]",
            lambda c: c.distributed.master.collaborators,
            ["alice", "bob"],
        ),
        (
            # options belong to a plugin model without a config class of its own (the transformer's
            # typed config refuses them at validation now, see test_model_contract.py)
            "model={name: my-plugin-model, options: {depth: 3, kinds: [a, b]}}",
            lambda c: c.model.options,
            {"depth": 3, "kinds": ["a", "b"]},
        ),
        ("run.output_dir=a=b", lambda c: c.run.output_dir, "a=b"),
        ("run.output_dir=", lambda c: c.run.output_dir, None),
        ("run.name='123'", lambda c: c.run.name, "123"),
        (" run.seed =5", lambda c: c.run.seed, 5),
    ],
)
def test_set_values_are_parsed_as_yaml(override: str, getter: Any, expected: Any) -> None:
    cfg = load_config(SMOKE, [override])
    value = getter(cfg)
    if isinstance(expected, float):
        assert value == pytest.approx(expected)
    else:
        assert value == expected


def test_set_can_replace_a_whole_section_and_create_missing_ones() -> None:
    cfg = load_config({}, ["model={n_layer: 3, n_head: 2, d_model: 32}", "scheduler.name=linear"])
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.d_model) == (3, 2, 32)
    assert cfg.scheduler.name == "linear"


def test_set_is_applied_before_validation_and_derivation(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  n_layer: 0\nrun:\n  max_steps: 10\n")
    assert "model.n_layer" in str(config_error(path))
    cfg = load_config(path, ["model.n_layer=2", "run.max_steps=40"])
    assert cfg.model.n_layer == 2
    assert plan(cfg).schedule_steps == 40 and plan(cfg).warmup_steps == 2


def test_later_overrides_win() -> None:
    assert load_config({}, ["optimizer.lr=0.1", "optimizer.lr=0.2"]).optimizer.lr == pytest.approx(0.2)


def test_unparseable_yaml_value_is_kept_as_a_string_and_judged_by_validation() -> None:
    message = str(config_error({}, ["run.max_steps=[1, 2"]))
    assert "run.max_steps" in message
    assert load_config({}, ["run.output_dir=[oops"]).run.output_dir == "[oops"


@pytest.mark.parametrize("override", ["optimizer.lr", "just-words", ""])
def test_override_without_equals_is_a_config_error(override: str) -> None:
    assert "KEY=VALUE" in str(config_error({}, [override]))


@pytest.mark.parametrize("override", ["=3", "optimizer..lr=3", ".lr=3", "optimizer.=3"])
def test_override_with_an_empty_key_part_is_a_config_error(override: str) -> None:
    assert "dotted path" in str(config_error({}, [override]))


def test_override_below_a_scalar_is_a_config_error() -> None:
    message = str(config_error({"run": {"name": "x"}}, ["run.name.first=1"]))
    assert "run.name" in message and "not a section" in message


def test_override_unknown_section_is_an_unknown_key() -> None:
    message = str(config_error({}, ["optimzer.lr=0.1"]))
    assert "optimzer" in message and "did you mean 'optimizer'" in message


# ------------------------------------------------------------------------------------------- compile


@pytest.mark.parametrize(
    ("source", "overrides", "enabled", "mode", "fullgraph"),
    [
        ({"compile": True}, [], True, None, False),
        ({"compile": False}, [], False, None, False),
        ({}, ["compile=true"], True, None, False),
        (
            {"compile": {"enabled": True, "mode": "max-autotune", "fullgraph": True}},
            [],
            True,
            "max-autotune",
            True,
        ),
        ({"compile": {"enabled": True}}, ["compile.mode=reduce-overhead"], True, "reduce-overhead", False),
        ({}, [], "auto", None, False),
        ({"compile": "auto"}, ["compile.mode=max-autotune"], "auto", "max-autotune", False),
    ],
)
def test_compile_accepts_a_flag_or_a_mapping(
    source: dict[str, Any], overrides: list[str], enabled: bool | str, mode: str | None, fullgraph: bool
) -> None:
    compile_ = load_config(source, overrides).compile
    assert (compile_.enabled, compile_.mode, compile_.fullgraph) == (enabled, mode, fullgraph)


def test_set_compile_field_over_the_flag_form(tmp_path: Path) -> None:
    """`compile: true` in the file is shorthand for a mapping, so `--set compile.mode=...` must still work."""
    path = write(tmp_path, "compile: true\n")
    compile_ = load_config(path, ["compile.mode=reduce-overhead"]).compile
    assert (compile_.enabled, compile_.mode) == (True, "reduce-overhead")


@pytest.mark.parametrize(
    ("source", "path"),
    [
        ({"compile": "yes please"}, "compile"),
        ({"compile": {"mode": "turbo"}}, "compile.mode"),
        ({"compile": {"enable": True}}, "compile.enable"),
    ],
)
def test_invalid_compile_settings(source: dict[str, Any], path: str) -> None:
    assert f"{path}:" in str(config_error(source))


# --------------------------------------------------------------------------------------- distributed


@pytest.mark.parametrize(
    ("node", "role"),
    [
        ({}, "master"),
        ({"id": "master"}, "master"),
        ({"id": "worker-3"}, "worker"),
        ({"id": "gpu-box", "role": "master"}, "master"),
        ({"role": "worker"}, "worker"),
        ({"id": "master", "role": "worker"}, "worker"),
    ],
)
def test_distributed_role_is_inferred_from_node_id(node: dict[str, Any], role: str) -> None:
    config = load_config({"distributed": {"node": node}})
    assert config.distributed.node.resolved_role() == role
    assert config.distributed.node.role == node.get("role")  # derived, never written back


def test_distributed_invalid_role_and_retry_bounds() -> None:
    assert "distributed.node.role" in str(config_error({}, ["distributed.node.role=boss"]))
    message = str(config_error({}, ["distributed.bus.retry_initial=10", "distributed.bus.retry_max=1"]))
    assert "retry_max" in message and "retry_initial" in message


# ------------------------------------------------------------------------------------------- secrets


def token_config(token: str) -> Config:
    return load_config(SMOKE, [f"distributed.bus.token={token}"])


def test_token_from_config(tmp_path: Path) -> None:
    path = write(tmp_path, "distributed:\n  token: fromConfigSecret0001\n")
    token = load_config(path).distributed.bus.token
    assert token is not None and token.get_secret_value() == "fromConfigSecret0001"


@pytest.mark.parametrize("variable", ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"])
def test_token_from_environment_when_absent(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    assert load_config(SMOKE).distributed.bus.token is None
    monkeypatch.setenv(variable, "fromEnvSecret0002")
    token = load_config(SMOKE).distributed.bus.token
    assert token is not None and token.get_secret_value() == "fromEnvSecret0002"


def test_token_in_config_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "fromEnvSecret0003")
    token = token_config("fromConfigSecret0003").distributed.bus.token
    assert token is not None and token.get_secret_value() == "fromConfigSecret0003"


def test_dumps_redact_the_token() -> None:
    cfg = token_config("dumpSecret0004")
    dumped = dump_config(cfg)
    assert dumped["distributed"]["bus"]["token"] == REDACTED
    assert "dumpSecret0004" not in json.dumps(dumped)
    text = config_to_yaml(cfg)
    assert "dumpSecret0004" not in text
    assert yaml.safe_load(text)["distributed"]["bus"]["token"] == REDACTED
    assert dump_config(cfg, redact=False)["distributed"]["bus"]["token"] == "dumpSecret0004"
    assert "dumpSecret0004" in config_to_yaml(cfg, redact=False)
    assert (
        dump_config(load_config(SMOKE))["distributed"]["bus"]["token"] is None
    )  # no token: nothing to redact


def test_repr_and_str_hide_the_token() -> None:
    cfg = token_config("reprSecret0005")
    for text in (repr(cfg), str(cfg), repr(cfg.distributed), str(cfg.distributed), cfg.model_dump_json()):
        assert "reprSecret0005" not in text
    assert "reprSecret0005" not in str(cfg.model_dump())


@pytest.mark.parametrize(
    "overrides",
    [
        ["distributed.bus.token={{value: {token}}}"],  # token of the wrong type
        ["distributed.bus.token=[{token}]"],
        ["distributed.tokn={token}"],  # an unknown key whose value is the token
        ["distributed.hf_token={token}", "distributed.enabled=maybe"],
        ["distributed.bus.token={token}", "run.name={token}", "model.n_layer=0"],
        ["distributed.bus.token={token}", "run.max_steps={token}"],  # the token itself is the invalid value
        ["distributed.bus.token={token}", "run.device={token}"],  # ... and the validator's message quotes it
        ["distributed.bus.token={token}", "logging.hooks={token}"],
    ],
)
def test_config_errors_never_contain_the_token(overrides: list[str]) -> None:
    token = f"plainSecretValue{zlib.crc32(repr(overrides).encode())}"  # unique: no other test remembered it
    message = str(config_error({}, [item.format(token=token) for item in overrides]))
    assert token not in message
    assert message.startswith("invalid config")


def test_config_errors_never_contain_the_environment_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "envSecretValue0006")
    message = str(config_error({}, ["run.device=envSecretValue0006"]))
    assert "run.device" in message and "envSecretValue0006" not in message


def test_token_in_a_file_with_an_invalid_sibling_is_not_echoed(tmp_path: Path) -> None:
    path = write(tmp_path, "distributed:\n  token: fileSecret0007\n  enabled: fileSecret0007\n")
    message = str(config_error(path))
    assert "distributed.enabled" in message and "fileSecret0007" not in message


def test_malformed_override_does_not_echo_an_hf_token() -> None:
    """`--set distributed.bus.token:hf_…` (a colon instead of '=') must not put the token in the error."""
    token = "hf_secretTOKENvalue1234567890"
    message = str(config_error({}, [f"distributed.bus.token:{token}"]))
    assert "KEY=VALUE" in message
    assert token not in message


# ---------------------------------------------------------------------------------------- round trip


def rich_config(token: str) -> Config:
    return load_config(
        SMOKE,
        [
            f"distributed.bus.token={token}",
            "distributed.node.id=worker-1",
            "compile=true",
            "lr=0.01",
            "data.target_batch_size=32",
            "optimizer.betas=[0.85, 0.98]",
            "model.name=my-plugin-model",  # a model without a config class: it takes model.options
            "model.options={a: 1}",
            "logging.hooks=[jsonl, tensorboard]",
        ],
    )


def test_round_trip_without_redaction(tmp_path: Path) -> None:
    cfg = rich_config("roundTripSecret0008")
    again = load_config(dump_config(cfg, redact=False))
    assert again == cfg
    assert again.distributed.bus.token is not None
    assert again.distributed.bus.token.get_secret_value() == "roundTripSecret0008"
    path = write(tmp_path, config_to_yaml(cfg, redact=False))
    assert load_config(path) == cfg


def test_round_trip_with_redaction_drops_only_the_token(tmp_path: Path) -> None:
    cfg = rich_config("roundTripSecret0009")
    path = write(tmp_path, config_to_yaml(cfg))
    again = load_config(path)
    assert again.distributed.bus.token is None  # the redacted marker loads back as "not set"
    expected = dump_config(cfg, redact=False)
    expected["distributed"]["bus"]["token"] = None
    assert dump_config(again, redact=False) == expected
    assert load_config(dump_config(cfg)) == again


def test_redacted_dump_picks_up_the_environment_token(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = rich_config("roundTripSecret0010")
    monkeypatch.setenv("HF_TOKEN", "envSecretValue0011")
    token = load_config(dump_config(cfg)).distributed.bus.token
    assert token is not None and token.get_secret_value() == "envSecretValue0011"


def test_round_trip_of_defaults_is_a_fixed_point() -> None:
    cfg = load_config({})
    dumped = dump_config(cfg)
    assert dump_config(load_config(dumped)) == dumped
