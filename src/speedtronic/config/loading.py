"""Turn YAML text, a mapping and `--set` overrides into a validated `Config`, or one clear ConfigError.

Order: read YAML → expand friendly aliases → apply `--set a.b=value` overrides (value parsed as YAML)
→ fill the token from HF_TOKEN → validate. Errors name the file, the dotted field path and the fix;
unknown keys get a did-you-mean suggestion. Never echoes a secret.

Friendly aliases (top level of the YAML, or as `--set` keys):
    batch_size, micro_batch_size → data.micro_batch_size     lr, learning_rate → optimizer.lr
    seq_len, block_size          → data.block_size           seed → run.seed
    max_steps                    → run.max_steps             device → run.device
and inside sections: data.batch_size → data.micro_batch_size, data.seq_len → data.block_size,
optimizer.learning_rate → optimizer.lr. A section that only names its choice may be written as the
name: `optimizer: muon` is `optimizer: {name: muon}`, `model: transformer` is `model: {name: transformer}`.

The `model:` section is validated by the config class its model registered (config/models.py), looked
up in the `registries` given, else among the built-ins and then the installed plugins. Flat
`distributed.*` keys of configs written before its subsections are moved to their new place, with one
warning each (config/distributed.py).

This module knows the root model only as the class it is given (`load_root(Config, ...)`): the schema
(config/schema.py) imports it for `Config.from_yaml` and `load_config`, never the other way round.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from speedtronic import starters
from speedtronic.config.distributed import MOVED, migrate_flat_keys, moved_key
from speedtronic.config.models import DEFAULT_MODEL, model_config_class
from speedtronic.config.strict_yaml import StrictSafeLoader, parse_yaml, read_text_file
from speedtronic.errors import ConfigError
from speedtronic.secrets import REDACTED, env_token, remember_secret, scrub

Root = TypeVar("Root", bound=BaseModel)

ALIASES: dict[str, str] = {
    "batch_size": "data.micro_batch_size",
    "micro_batch_size": "data.micro_batch_size",
    "lr": "optimizer.lr",
    "learning_rate": "optimizer.lr",
    "seq_len": "data.block_size",
    "block_size": "data.block_size",
    "seed": "run.seed",
    "max_steps": "run.max_steps",
    "device": "run.device",
    "data.batch_size": "data.micro_batch_size",
    "data.seq_len": "data.block_size",
    "optimizer.learning_rate": "optimizer.lr",
}


# A config is a page of YAML. These bounds are checked before validation, so a YAML alias bomb (a few
# lines whose aliases repeat each other into billions of values) is refused at once instead of
# growing for minutes: the count is of values as they would be *expanded*, computed without expanding.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000
MAX_CONFIG_DEPTH = 64


def check_config_size(data: Any, origin: str) -> None:
    """Refuse a config that expands to more than MAX_CONFIG_VALUES values, nests deeper than
    MAX_CONFIG_DEPTH or refers to itself, naming the dotted path where it does."""
    sizes: dict[int, int | None] = {}  # container id → expanded size (None while being counted)

    def size(node: Any, path: str, depth: int) -> int:
        if isinstance(node, dict):
            children: Iterable[tuple[Any, Any]] = node.items()
        elif isinstance(node, (list, tuple)):
            children = enumerate(node)
        else:
            return 1
        known = sizes.get(id(node), 0)
        if known is None:
            raise ConfigError(f"{origin}: {path} contains itself (a recursive YAML alias)")
        if known:
            return known
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{origin}: {path} is nested more than {MAX_CONFIG_DEPTH} levels deep")
        sizes[id(node)] = None
        total = 1
        for key, value in children:
            total += size(value, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}", depth + 1)
            if total > MAX_CONFIG_VALUES:
                raise ConfigError(
                    f"{origin}: {path} expands to more than {MAX_CONFIG_VALUES:,} values (YAML aliases "
                    "repeat what they name); a run config is far smaller — remove the repetition"
                )
        sizes[id(node)] = total
        return total

    for key, value in data.items() if isinstance(data, dict) else ():
        size(value, str(key), 1)


# Sections that may be given as a bare name: `optimizer: muon` means `optimizer: {name: muon}`.
NAMED_SECTIONS = ("model", "optimizer")


def load_root(
    root: type[Root],
    source: str | Path | Mapping[str, Any] | None = None,
    overrides: Iterable[str] = (),
    *,
    registries: Any = None,
) -> Root:
    """Load and validate a run config as `root` (the schema's `Config`) from a YAML path or a mapping,
    applying `--set` overrides.

    `registries` (speedtronic.registry.Registries) gives the model config classes; None: the built-ins,
    then the installed plugins (asked only for a model name that is not built in)."""
    origin = str(source) if isinstance(source, (str, Path)) else "<mapping>"
    raw = read_yaml(source) if isinstance(source, (str, Path)) else dict(source or {})
    data = _expand_aliases(raw, origin, root)
    if isinstance(data.get("compile"), bool) or data.get("compile") == "auto":
        # so `--set compile.mode=…` works on `compile: true`
        data["compile"] = {"enabled": data["compile"]}
    if isinstance(data.get("distributed"), dict):
        # before the overrides, so `--set distributed.sync.inner_steps=…` wins over a flat key
        try:
            data["distributed"] = migrate_flat_keys(data["distributed"])
        except ConfigError as error:
            raise ConfigError(f"{origin}: {error}") from None
    for override in overrides:
        _apply_override(data, override)
    _fill_token(data)
    check_config_size(data, origin)
    try:
        config = root.model_validate(data, context={"registries": registries})
    except ValidationError as error:
        section = data.get("model")
        name = section.get("name", DEFAULT_MODEL) if isinstance(section, dict) else None
        model_class = model_config_class(name, registries) if isinstance(name, str) else None
        raise ConfigError(
            format_validation_error(error, origin, root=root, model_class=model_class)
        ) from None
    _remember_secrets(config)
    return config


def _remember_secrets(model: BaseModel) -> None:
    """Every secret in a validated config (the bus token) is scrubbed from what we print from now on."""
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, SecretStr):
            remember_secret(value.get_secret_value())
        elif isinstance(value, BaseModel):
            _remember_secrets(value)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a YAML config file, or the shipped config `path` names (`shakespeare`, see
    speedtronic.starters); syntax errors name the file and line."""
    name = starters.starter_name(path)
    path = Path(path)
    try:
        text = starters.starter_text(name) if name else read_text_file(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        shipped = ", ".join(starters.starters())
        close = starters.closest_starter(path)
        meant = f"did you mean {close}? Otherwise " if close else ""
        raise ConfigError(
            f"config file {path} not found; {meant}check the path, or name a shipped config ({shipped}; "
            "`speedtronic configs` lists them, `speedtronic init NAME` writes one to edit)"
        ) from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    loaded = parse_yaml(text, str(path))
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(loaded).__name__}")
    return loaded


def _expand_aliases(raw: dict[str, Any], origin: str, root: type[BaseModel]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    aliased: list[tuple[str, Any]] = []
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"{origin}: keys must be strings, got {key!r}")
        if key in ALIASES:
            aliased.append((key, value))
        elif value is None and key in root.model_fields:
            data[key] = {}  # an empty section (every line commented out) means its defaults
        elif key in NAMED_SECTIONS and isinstance(value, str):
            data[key] = {"name": value}  # so `--set optimizer.lr=…` works on `optimizer: muon`
        elif isinstance(value, dict):
            data[key] = {k: v for k, v in value.items()}
            for inner_key, inner_value in value.items():
                dotted = f"{key}.{inner_key}"
                if isinstance(inner_key, str) and dotted in ALIASES:
                    del data[key][inner_key]
                    aliased.append((dotted, inner_value))
        else:
            data[key] = value
    for alias, value in aliased:
        target = ALIASES[alias]
        section, field = target.split(".")
        existing = data.get(section)
        if isinstance(existing, dict) and field in existing:
            raise ConfigError(
                f"{origin}: both '{alias}' and '{target}' are set; keep one ({alias} is an alias)"
            )
        _set_path(data, target.split("."), value, origin=f"{origin}: {alias}")
    return data


def _apply_override(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"--set {scrub(override)!r}: expected KEY=VALUE, e.g. --set optimizer.lr=3e-4")
    key, text = override.split("=", 1)
    key = key.strip()
    key = moved_key(ALIASES.get(key, key))  # a flat distributed.* key: its new place, warned once
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {scrub(override)!r}: the key must be a dotted path such as optimizer.lr")
    try:
        value = yaml.load(text, Loader=StrictSafeLoader) if text.strip() else None
    except (Exception, RecursionError):
        value = text  # not YAML: keep the raw string and let validation judge it
    _set_path(data, key.split("."), value, origin=f"--set {key}")


def _set_path(data: dict[str, Any], parts: list[str], value: Any, *, origin: str) -> None:
    node = data
    for index, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif isinstance(child, BaseModel):
            child = node[part] = child.model_dump()
        elif not isinstance(child, dict):
            where = ".".join(parts[: index + 1])
            raise ConfigError(f"{origin}: {where} is not a section, so {'.'.join(parts)} cannot be set")
        node = child
    node[parts[-1]] = value


def _fill_token(data: dict[str, Any]) -> None:
    """distributed.bus.token: a redacted dump's marker means unset; unset, it comes from HF_TOKEN."""
    distributed = data.get("distributed")
    if distributed is not None and not isinstance(distributed, dict):
        return  # validation reports the type error
    section = (distributed or {}).get("bus")
    if section is not None and not isinstance(section, dict):
        return
    token = (section or {}).get("token")
    if token == REDACTED:  # a redacted dump loaded back means "not given here"
        token = None
        section["token"] = None  # type: ignore[index]
    if token:
        remember_secret(str(token))
        return
    env = env_token()
    if env:
        data["distributed"] = {**(distributed or {}), "bus": {**(section or {}), "token": env}}


def format_validation_error(
    error: ValidationError,
    origin: str,
    *,
    root: type[BaseModel],
    model_class: type[BaseModel] | None = None,
) -> str:
    """One line per problem: `origin: dotted.path: what is wrong (got value) — hint`. `root` is the
    class that was validated (the run's `Config`); `model_class` the class that validated the `model`
    section (for its field names and did-you-mean hints)."""
    lines = []
    for item in error.errors(include_url=False):
        loc = [part for part in item["loc"] if not str(part).startswith("function-")]
        # Pydantic reports union branches (e.g. `bool` then `literal`) as extra loc parts; keep field names.
        fields = _strip_union_tags(loc, root, model_class)
        path = ".".join(str(part) for part in fields) or "config"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            hint = _did_you_mean(fields, root, model_class)
            message = "unknown key" + (f"; did you mean '{hint}'?" if hint else "")
        elif "token" not in path and isinstance(item.get("input"), (str, int, float, bool)):
            shown = repr(item["input"])
            if shown not in message:
                message += f" (got {shown[:60]}{'…' if len(shown) > 60 else ''})"
        # Cross-field rules already start with the dotted field they are about.
        lines.append(
            message
            if message.startswith(
                ("model.", "data.", "optimizer.", "scheduler.", "distributed.", "run.", "checkpoint.")
            )
            else f"{path}: {message}"
        )
    header = f"invalid config {origin}" if origin != "<mapping>" else "invalid config"
    unique = list(dict.fromkeys(lines))
    return scrub(f"{header}: " + "; ".join(unique))


def _section_class(
    cls: type[BaseModel], part: str, model_class: type[BaseModel] | None, root: type[BaseModel]
) -> Any:
    """The class of field `part` of `cls`: a section's class, the resolved model class, or None."""
    if cls is root and part == "model" and model_class is not None:
        return model_class
    field = cls.model_fields.get(part)
    annotation = field.annotation if field else None
    # A list of sections, optional or not (data.sources): the element's class names what follows the index.
    for _ in range(2):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1 and not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            annotation = inner[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _strip_union_tags(
    loc: list[Any], root: type[BaseModel], model_class: type[BaseModel] | None = None
) -> list[Any]:
    known: list[Any] = []
    cls: type[BaseModel] | None = root
    for part in loc:
        if cls is not None and isinstance(part, str) and part in cls.model_fields:
            known.append(part)
            cls = _section_class(cls, part, model_class, root)
        elif cls is not None and isinstance(part, str) and part not in cls.model_fields:
            known.append(part)  # an unknown key: keep it so the message names it
            cls = None
        elif isinstance(part, int):
            known.append(f"[{part}]" if not known else part)
    return known


def _did_you_mean(
    loc: list[Any], root: type[BaseModel], model_class: type[BaseModel] | None = None
) -> str | None:
    cls: type[BaseModel] = root
    for part in loc[:-1]:
        inner = _section_class(cls, str(part), model_class, root)
        if inner is None:
            return None
        cls = inner
    candidates = list(cls.model_fields)
    prefix = ".".join(str(p) for p in loc[:-1])
    candidates += [
        a.split(".")[-1] for a in ALIASES if a.count(".") == (1 if prefix else 0) and a.startswith(prefix)
    ]
    if prefix == "distributed":
        candidates += list(MOVED)  # a misspelt flat key: suggest where it lives now
    match = difflib.get_close_matches(str(loc[-1]), candidates, n=1, cutoff=0.6)
    if not match:
        return None
    if prefix == "distributed" and match[0] in MOVED:
        return "distributed.{}.{}".format(*MOVED[match[0]])
    return f"{prefix}.{match[0]}" if prefix else match[0]
