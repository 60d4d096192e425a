"""Property tests: whatever YAML text, mapping or `--set` strings a user gives, `load_config` returns a
Config or raises ConfigError, never another exception; a Config it returns dumps and loads back equal."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, SecretStr

from speedtronic.config import ALIASES, Config, config_to_yaml, load_config
from speedtronic.config.schema import SECTIONS
from speedtronic.errors import ConfigError

pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

FIELDS = {name: list(section.model_fields) for name, section in SECTIONS.items()}
TOP_LEVEL = [name for name in Config.model_fields if name not in SECTIONS]
TYPOS = ["optimiser", "modle", "lrr", "n_layers", "batchsize", "tokn", "", "run.name", "__class__"]
ALL_FIELDS = sorted({field for fields in FIELDS.values() for field in fields})
DOTTED = [f"{section}.{field}" for section, fields in FIELDS.items() for field in fields]

STRUCTURE = ["\n", "\n  ", "  ", "- ", ": ", ":", "{", "}", "[", "]", ", ", "? ", "<<: ", "&a ", "*a"]
STRUCTURE += ["#", "\t"]
QUOTES_AND_DIRECTIVES = ["'", '"', "|\n", ">\n", "---\n", "...\n", "%YAML 1.1\n", "\x00", "\ufeff", "é"]
TAGS = ["!!int ", "!!float ", "!!bool ", "!!str ", "!!null ", "!!timestamp ", "!!binary ", "!!set ", "!!map "]
TAGS += ["!!python/object:os.system ", "!custom "]
WORDS = ["0", "-1", "1.5", "3e-4", ".inf", ".nan", "null", "~", "yes", "no", "true", "x", "abc", "2024-01-01"]
WORDS += ["0x1F", "hf_abcdefgh1234567"]
YAML_FRAGMENTS = [*FIELDS, *ALL_FIELDS[:20], *ALIASES, *STRUCTURE, *QUOTES_AND_DIRECTIVES, *TAGS, *WORDS]
yaml_like_text = st.lists(st.sampled_from(YAML_FRAGMENTS), max_size=30).map("".join)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, 2, 4, 8, 16, 64, 128, 256, 1000]),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, width=32),
    st.sampled_from(
        ["auto", "cpu", "cuda:0", "mps", "adamw", "muon", "row", "cosine", "bf16", "jsonl", "master"]
    ),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(ALL_FIELDS + TYPOS), children, max_size=3)
    ),
    max_leaves=6,
)


STRINGS = {
    "device": ["auto", "cpu", "cuda", "cuda:1", "mps"],
    "name": ["transformer", "adamw", "muon", "smoke"],
}


def plausible(dotted: str) -> st.SearchStrategy[Any]:
    """Values of the right type for one field (from its annotation), so many drawn configs are valid."""
    section, _, name = dotted.rpartition(".")
    field = (SECTIONS[section] if section else Config).model_fields[name]
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):  # a subsection (distributed.fsdp, …): as the YAML would write it
        default = default.model_dump(mode="json")
    kinds: list[st.SearchStrategy[Any]] = [st.just(default)]
    pending = [field.annotation]
    while pending:
        kind = pending.pop()
        args = get_args(kind)
        if get_origin(kind) is Literal:
            kinds.append(st.sampled_from(args))
        elif get_origin(kind) is tuple:
            kinds.append(st.tuples(*[st.floats(0.0, 0.999)] * len(args)).map(list))
        elif get_origin(kind) is list:
            kinds.append(st.lists(st.sampled_from(["jsonl", "csv", "alice"]), max_size=2))
        elif get_origin(kind) is dict:
            kinds.append(st.dictionaries(st.text(max_size=5), scalars, max_size=2))
        elif args:
            pending.extend(args)
        elif kind is bool:
            kinds.append(st.booleans())
        elif kind is int:
            kinds.append(st.sampled_from([1, 2, 4, 8, 8, 16, 16, 64, 0, 2048]))
        elif kind is float:
            kinds.append(st.floats(0.0, 2.0))
        elif kind is str or kind is SecretStr:
            kinds.append(st.sampled_from(STRINGS.get(name, ["x", "run-1", "master", "w1"])))
        elif kind is type(None):
            kinds.append(st.none())
    return st.one_of(kinds)


@st.composite
def config_mappings(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly well-typed sections with plausible values, plus typos, aliases, wrong shapes and junk."""
    mapping: dict[str, Any] = {}
    keys = draw(st.lists(st.sampled_from([*FIELDS, *TOP_LEVEL, *ALIASES, *TYPOS]), max_size=5, unique=True))
    for key in keys:
        fields = FIELDS.get(key)
        roll = draw(st.integers(0, 19))
        if fields is None or roll == 0:
            target = ALIASES.get(key, key)
            known = roll > 0 and (target in TOP_LEVEL or target in DOTTED)
            mapping[key] = draw(plausible(target) if known else values)
            continue
        names = draw(st.lists(st.sampled_from(fields), max_size=3, unique=True))
        mapping[key] = {name: draw(plausible(f"{key}.{name}") if roll > 2 else values) for name in names}
        if roll == 1:
            mapping[key][draw(st.sampled_from(TYPOS))] = draw(values)
    return mapping


overrides = st.lists(
    st.one_of(
        st.text(max_size=30),
        st.builds(
            lambda key, text: f"{key}={text}",
            st.sampled_from(
                [*DOTTED, *ALIASES, *FIELDS, *TYPOS, "model.options.x", "run.name.x", "distributed.bus.token"]
            ),
            st.one_of(yaml_like_text, st.text(max_size=15), values.map(lambda v: yaml.safe_dump(v).strip())),
        ),
    ),
    max_size=4,
)


def check(source: Any, sets: Sequence[str] = ()) -> None:
    """The property: a Config that survives dump → YAML → load unchanged, or a ConfigError (exit 2)."""
    try:
        cfg = load_config(source, sets)
    except ConfigError as error:
        assert error.exit_code == 2
        assert str(error).strip()
        return
    assert isinstance(cfg, Config)
    assert load_config(yaml.safe_load(config_to_yaml(cfg, redact=False))) == cfg


@FUZZ
@given(text=st.one_of(st.text(max_size=200), yaml_like_text))
@example(text="run:\n  seed: !!int abc\n")
@example(text="optimizer: {lr: !!float fast}\n")
def test_any_yaml_text_loads_or_raises_config_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        cfg = load_config(path)
    except ConfigError as error:
        assert error.exit_code == 2 and str(error).strip()
    else:  # no round trip here: YAML anchors can build a cyclic model.options, which cannot be dumped
        assert isinstance(cfg, Config)


@FUZZ
@given(mapping=config_mappings())
@example(mapping={"run": {"name": "x"}, "distributed": None})
def test_any_mapping_dumped_as_yaml_loads_or_raises_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapping: dict[str, Any]
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_fuzzEnvironmentToken123")  # exercise the token-filling path too
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(mapping), encoding="utf-8")
    check(path)
    check(mapping)


@FUZZ
@given(sets=overrides)
@example(sets=["run.seed=!!int abc"])
def test_any_set_overrides_load_or_raise_config_error(sets: list[str]) -> None:
    check(SMOKE, sets)
    check({"compile": True, "distributed": {}}, sets)
