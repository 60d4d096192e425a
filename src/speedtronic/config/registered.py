"""Sections validated by a class that a plugin registers: `model:` (config/models.py) and `optimizer:`
(config/optimizers.py) find their class the same way, here.

A name registered with `config=Cls` is validated by Cls; a name registered without one, or that nobody
registered, by the family's fallback class. Without registries the built-ins are asked first, then the
installed plugins (speedtronic.plugins.default_config_class). Never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from speedtronic.config.section import Section
from speedtronic.plugins import default_config_class
from speedtronic.registry import Registries

S = TypeVar("S", bound=Section)


def registered_class(kind: str, name: Any, fallback: type[S], registries: Registries | None) -> type[S]:
    """The config class registered for `name` in registry `kind` ("models", "optimizers"), else `fallback`."""
    if not isinstance(name, str):
        return fallback
    if registries is not None:
        entry = getattr(registries, kind).entries.get(name)
        return (entry.config if entry is not None else None) or fallback
    return default_config_class(kind, name) or fallback


def resolve_registered(
    value: Any,
    *,
    kind: str,
    family: type[Section],
    fallback: type[S],
    default_name: str,
    registries: Registries | None,
) -> S:
    """A section given as a mapping, a config of the `family`, a bare name or None, validated by its
    name's class; a config validated by another class (loaded without these registries) is validated
    again by the right one."""
    if isinstance(value, str):
        value = {"name": value}  # `model: transformer` is short for `model: {name: transformer}`
    elif value is None:
        value = {}
    if isinstance(value, family):
        name = getattr(value, "name", None)
        target = registered_class(kind, name, fallback, registries)
        if type(value) is target:
            return value  # type: ignore[return-value]
        value = {**value.model_dump(exclude_unset=True), "name": name}
    if not isinstance(value, Mapping):
        return fallback.model_validate(value)  # the type error names the section
    return registered_class(kind, value.get("name", default_name), fallback, registries).model_validate(
        dict(value)
    )
