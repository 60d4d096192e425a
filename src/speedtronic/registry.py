"""Named registries of models, optimizers, training hooks and DiLoCo bus backends, filled through the plugin hooks.

Each entry remembers which plugin registered it, so a name registered twice is an error naming both
plugins, and `speedtronic plugins` can say what each plugin provides. A registration may declare
facts the engine uses instead of switching on names (keywords of `register(name, factory, ...)`):

    models      config=Cls           the model's typed config, a subclass of
                                     speedtronic.config.models.BaseModelConfig (validates `model:`)
    optimizers  config=Cls           the optimizer's typed config, a subclass of
                                     speedtronic.config.optimizers.OptimizerConfig (validates `optimizer:`)
                state_elements=k|fn  optimizer state it keeps: k float32 values per parameter, or
                                     fn(model) -> the count (the memory plan; default 2 per parameter)

`builtin_registries()` fills fresh registries from the core's own plugin modules alone (what the engine
uses when it is handed none); the plugin host (speedtronic.plugins) adds the installed plugins.
"""

from __future__ import annotations

import difflib
import importlib
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
    declared: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> Any:
        """A model's or optimizer's declared config class (None: the generic ModelConfig or
        OptimizerConfig)."""
        return self.declared.get("config")


# The core's own plugins (speedtronic.builtin), loaded by name like an installed plugin's entry point.
BUILTIN_MODULES = (
    "speedtronic.builtin.models",
    "speedtronic.builtin.optimizers",
    "speedtronic.builtin.hooks",
)

# The built-in DiLoCo bus backends by URL scheme, as "module:Class" strings imported only when a URL of
# theirs is opened (speedtronic.diloco.bus.registry serves URLs from them; a plugin may not take one).
BUILTIN_BACKENDS: dict[str, str] = {
    "file": "speedtronic.diloco.bus.directory:DirectoryBus",
    "hub": "speedtronic.diloco.bus.hub:HubBus",
    "s3": "speedtronic.diloco.bus.s3:S3Bus",
}


def _subclass_check(base: str) -> Callable[[Any], str | None]:
    """A check that a declared class derives from `base` ("module.Class"). The registry sits below the
    config package, which resolves sections through it, so it knows the base by its qualified name."""

    def check(value: Any) -> str | None:
        mro = value.__mro__ if isinstance(value, type) else ()
        if any(f"{c.__module__}.{c.__qualname__}" == base for c in mro):
            return None
        return f"config= must be a subclass of {base}"

    return check


_check_model_config = _subclass_check("speedtronic.config.models.BaseModelConfig")
_check_optimizer_config = _subclass_check("speedtronic.config.optimizers.OptimizerConfig")


def _check_state_elements(value: Any) -> str | None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return None if number or callable(value) else "state_elements= must be a number >= 0 or fn(model) -> int"


# What each kind of registration may declare, with a check of the value (an error message or None).
DECLARABLE: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "model": {"config": _check_model_config},
    "optimizer": {"config": _check_optimizer_config, "state_elements": _check_state_elements},
    "hook": {},
}


@dataclass
class Registry:
    """Factories by name; `field` is the config key that selects from it (for error messages)."""

    kind: str
    field: str
    entries: dict[str, Entry] = field(default_factory=dict)
    # Bus backends may be "module:Class" strings, imported only when a URL of theirs is opened.
    lazy: bool = False

    def add(self, name: str, factory: Callable[..., Any], plugin: str, **declared: Any) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} with an invalid name {name!r}")
        if not callable(factory) and not (self.lazy and isinstance(factory, str) and ":" in factory):
            raise PluginError(
                f"plugin {plugin!r} registered {self.kind} {name!r} with a non-callable factory"
            )
        allowed = DECLARABLE.get(self.kind, {})
        for key, value in declared.items():
            check = allowed.get(key)
            problem = (
                f"unknown keyword {key}= (a {self.kind} may declare: {', '.join(allowed) or 'nothing'})"
                if check is None
                else check(value)
            )
            if problem:
                raise PluginError(f"plugin {plugin!r} registered {self.kind} {name!r}: {problem}")
        existing = self.entries.get(name)
        if existing is not None:
            raise PluginError(
                f"{self.kind} {name!r} is registered by both {existing.plugin!r} and {plugin!r}; "
                f"uninstall one or limit plugins with SPEEDTRONIC_LOAD_PLUGINS"
            )
        self.entries[name] = Entry(name, factory, plugin, dict(declared))

    def remove_plugin(self, plugin: str) -> None:
        self.entries = {k: v for k, v in self.entries.items() if v.plugin != plugin}

    def get(self, name: str) -> Callable[..., Any]:
        return self.entry(name).factory

    def entry(self, name: str) -> Entry:
        """The registration of `name`; ConfigError naming the field (and a close match) if none."""
        entry = self.entries.get(name)
        if entry is None:
            known = sorted(self.entries)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"{self.field}: unknown {self.kind} {name!r}; {hint}registered: {', '.join(known) or 'none'} "
                "(see `speedtronic plugins --all`)"
            )
        return entry

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
    delta_checks: Registry = field(default_factory=lambda: Registry("delta check", "register_delta_checks"))

    def by_hook(self) -> dict[str, Registry]:
        return {
            "register_models": self.models,
            "register_optimizers": self.optimizers,
            "register_hooks": self.hooks,
            "register_buses": self.buses,
            "register_delta_checks": self.delta_checks,
        }


def builtin_registries() -> Registries:
    """Fresh registries holding the built-in models, optimizers and hooks only (no installed plugin):
    what the engine uses when it is handed no registries."""
    registries = Registries()
    for module_name in BUILTIN_MODULES:
        module = importlib.import_module(module_name)
        for hook_name, registry in registries.by_hook().items():
            register = getattr(module, hook_name, None)
            if register is not None:
                register(
                    register=lambda name, factory, _r=registry, _m=module_name, **declared: _r.add(
                        name, factory, _m, **declared
                    )
                )
    return registries


def resolve_registries(registries: Registries | None) -> Registries:
    """`registries`, or the built-ins when None (the engine's default: it never loads installed plugins)."""
    return registries if registries is not None else builtin_registries()
