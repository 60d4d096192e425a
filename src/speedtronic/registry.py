"""Named registries of models, optimizers, training hooks and DiLoCo bus backends, filled through the plugin hooks.

Each entry remembers which plugin registered it, so a name registered twice is an error naming both
plugins, and `speedtronic plugins` can say what each plugin provides.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from speedtronic.errors import ConfigError, SpeedtronicError


class PluginError(SpeedtronicError):
    """A plugin that cannot be loaded or that conflicts with another one."""


@dataclass
class Entry:
    name: str
    factory: Callable[..., Any]
    plugin: str


@dataclass
class Registry:
    """Factories by name; `field` is the config key that selects from it (for error messages)."""

    kind: str
    field: str
    entries: dict[str, Entry] = field(default_factory=dict)
    # Bus backends may be "module:Class" strings, imported only when a URL of theirs is opened.
    lazy: bool = False

    def add(self, name: str, factory: Callable[..., Any], plugin: str) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} with an invalid name {name!r}")
        if not callable(factory) and not (self.lazy and isinstance(factory, str) and ":" in factory):
            raise PluginError(
                f"plugin {plugin!r} registered {self.kind} {name!r} with a non-callable factory"
            )
        existing = self.entries.get(name)
        if existing is not None:
            raise PluginError(
                f"{self.kind} {name!r} is registered by both {existing.plugin!r} and {plugin!r}; "
                f"uninstall one or limit plugins with SPEEDTRONIC_LOAD_PLUGINS"
            )
        self.entries[name] = Entry(name, factory, plugin)

    def remove_plugin(self, plugin: str) -> None:
        self.entries = {k: v for k, v in self.entries.items() if v.plugin != plugin}

    def get(self, name: str) -> Callable[..., Any]:
        entry = self.entries.get(name)
        if entry is None:
            known = sorted(self.entries)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{self.field}: unknown {self.kind} {name!r}; {hint}registered: {', '.join(known) or 'none'} "
                "(see `speedtronic plugins --all`)"
            )
        return entry.factory

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries


@dataclass
class Registries:
    models: Registry = field(default_factory=lambda: Registry("model", "model.name"))
    optimizers: Registry = field(default_factory=lambda: Registry("optimizer", "optimizer.name"))
    hooks: Registry = field(default_factory=lambda: Registry("hook", "logging.hooks"))
    buses: Registry = field(default_factory=lambda: Registry("bus", "--repo", lazy=True))

    def by_hook(self) -> dict[str, Registry]:
        return {
            "register_models": self.models,
            "register_optimizers": self.optimizers,
            "register_hooks": self.hooks,
            "register_buses": self.buses,
        }
