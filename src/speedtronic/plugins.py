"""The plugin host: loads built-in and installed plugins (pluggy) and builds the registries from them.

Plugins come from the entry-point group "speedtronic". `SPEEDTRONIC_LOAD_PLUGINS` (comma-separated
distribution or entry-point names; empty for none) limits which installed plugins load. A plugin
that fails to import or to register — also by calling `sys.exit()` — is skipped with a warning
naming it and the hook, and everything else keeps working; `SPEEDTRONIC_STRICT_PLUGINS=1` raises instead (for plugin authors). The core's own model,
optimizers and hooks are "default plugins", registered through the very same hooks (the built-in
DiLoCo bus backends are listed in speedtronic.registry; plugins add more by URL scheme).

The built-in plugin modules are named in speedtronic.registry and loaded by name, exactly as an installed
plugin's entry point is, so the config may ask the host for a model's config class without importing
the plugins that import the config.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from speedtronic import hookspecs
from speedtronic.registry import (
    BUILTIN_BACKENDS,
    BUILTIN_MODULES,
    PluginError,
    Registries,
    Registry,
    builtin_registries,
)

ENTRY_POINT_GROUP = "speedtronic"


@dataclass
class PluginInfo:
    """What `speedtronic plugins` shows for one plugin."""

    name: str
    version: str | None
    builtin: bool
    hooks: list[str] = field(default_factory=list)
    registers: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "builtin": self.builtin,
            "hooks": self.hooks,
            "registers": self.registers,
        }


def strict_mode() -> bool:
    return os.environ.get("SPEEDTRONIC_STRICT_PLUGINS", "").strip().lower() in ("1", "true", "yes")


class PluginHost:
    """A pluggy PluginManager plus the registries its plugins fill, with per-plugin isolation."""

    def __init__(self, *, load_installed: bool = True) -> None:
        self.manager = pluggy.PluginManager("speedtronic")
        self.manager.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.warnings: list[str] = []
        # Called with each warning as it happens once the CLI has shown the earlier ones (a register_*
        # hook runs only when the registries are first needed, after start-up).
        self.on_warning: Any = None
        self._registries: Registries | None = None
        for module_name in BUILTIN_MODULES:
            self.register(importlib.import_module(module_name), name=module_name, builtin=True)
        if load_installed:
            self._load_entry_points()

    # -- loading -------------------------------------------------------------------------------
    def register(self, plugin: Any, name: str, *, version: str | None = None, builtin: bool = False) -> None:
        """Register a plugin object or module directly (tests, notebooks); rebuilds registries lazily."""
        self.manager.register(plugin, name=name)
        hooks = sorted(
            caller.name
            for caller in self.manager.get_hookcallers(plugin) or []
            if caller.name in hookspecs.HOOK_NAMES
        )
        self.infos[name] = PluginInfo(name=name, version=version, builtin=builtin, hooks=hooks)
        self._registries = None

    def unregister(self, name: str) -> None:
        self.manager.unregister(name=name)
        self.infos.pop(name, None)
        self._registries = None

    def _load_entry_points(self) -> None:
        allowed = _allowed_plugins()
        for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            dist_name = dist.metadata["Name"] if dist is not None else entry_point.name
            if allowed is not None and not ({dist_name, entry_point.name} & allowed):
                continue
            name = dist_name if dist_name not in self.infos else f"{dist_name}:{entry_point.name}"
            try:
                plugin = entry_point.load()
                self.register(plugin, name=name, version=dist.version if dist is not None else None)
            except (Exception, SystemExit) as error:  # a broken plugin must not break anything else
                self._fail(name, f"failed to load ({_describe(error)})", error)

    def _fail(self, plugin: str, what: str, error: BaseException) -> None:
        message = f"plugin {plugin!r} {what}; skipped (set SPEEDTRONIC_STRICT_PLUGINS=1 to raise)"
        if strict_mode():
            raise PluginError(message.split(";")[0]) from error
        self.warnings.append(message)
        if self.on_warning is not None:
            self.on_warning(message)

    # -- registries ----------------------------------------------------------------------------
    def registries(self) -> Registries:
        """Models, optimizers and hooks registered by every loaded plugin (built once, cached)."""
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries

    def _build_registries(self) -> Registries:
        registries = Registries()
        for info in self.infos.values():
            info.registers = {}
        for hook_name, registry in registries.by_hook().items():
            for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
                self._call_register_hook(impl, hook_name, registry)
        return registries

    def _call_register_hook(self, impl: Any, hook_name: str, registry: Registry) -> None:
        plugin = impl.plugin_name
        added: list[str] = []

        def register(name: str, factory: Any, **declared: Any) -> None:
            registry.add(name, factory, plugin, **declared)
            added.append(name)

        try:
            impl.function(register=register)
        except PluginError:
            raise  # two plugins claiming one name: the user must choose, so never skip silently
        except (Exception, SystemExit) as error:
            registry.remove_plugin(plugin)
            self._fail(plugin, f"failed in {hook_name} ({_describe(error)})", error)
            return
        if plugin in self.infos:
            plural = registry.kind + ("es" if registry.kind.endswith("s") else "s")
            self.infos[plugin].registers[plural] = sorted(added)

    def add_commands(self, app: Any) -> None:
        """Let plugins add CLI commands; a failing plugin is reported, the CLI still works."""
        for impl in self.manager.hook.register_commands.get_hookimpls():
            before = _command_names(app)
            try:
                impl.function(app=app)
            except (Exception, SystemExit) as error:
                self._fail(impl.plugin_name, f"failed in register_commands ({_describe(error)})", error)
                continue
            if impl.plugin_name in self.infos:
                self.infos[impl.plugin_name].registers["commands"] = sorted(_command_names(app) - before)

    def describe(self, *, include_builtin: bool = False) -> list[dict[str, Any]]:
        self.registries()
        return [info.as_dict() for info in self.infos.values() if include_builtin or not info.builtin]


def _describe(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"


def _command_names(app: Any) -> set[str]:
    names = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}
    return names | {g.name or g.typer_instance.info.name for g in app.registered_groups}


def _allowed_plugins() -> set[str] | None:
    value = os.environ.get("SPEEDTRONIC_LOAD_PLUGINS")
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


_host: PluginHost | None = None


def get_plugin_host() -> PluginHost:
    """The process-wide plugin host, created on first use."""
    global _host
    if _host is None:
        _host = PluginHost()
    return _host


def reset_plugin_host() -> None:
    """Forget the process-wide host (tests; after installing a plugin at run time)."""
    global _host
    _host = None


def registries() -> Registries:
    return get_plugin_host().registries()


def bus_backends() -> dict[str, Any]:
    """{URL scheme: Bus subclass or "module:Class"} registered by plugins (`register_buses`). A plugin
    may not take a built-in scheme: a run URL must mean the same storage wherever it is opened."""
    entries = registries().buses.entries
    for scheme, entry in entries.items():
        if scheme in BUILTIN_BACKENDS or scheme == "hf":
            raise PluginError(
                f"plugin {entry.plugin!r} registered the bus scheme {scheme}://, which is built in; "
                "uninstall it or limit plugins with SPEEDTRONIC_LOAD_PLUGINS"
            )
    return {scheme: entry.factory for scheme, entry in entries.items()}


@functools.cache
def _builtin_configs(kind: str) -> dict[str, type[Any] | None]:
    registry = getattr(builtin_registries(), kind)
    return {name: entry.config for name, entry in registry.entries.items()}


def default_config_class(kind: str, name: str) -> type[Any] | None:
    """The config class registered for `name` in registry `kind` ("models", "optimizers") when a
    section is validated without registries: the built-ins' (without loading installed plugins), then
    the installed plugins'. None: the name declared no class, or nobody registered it."""
    builtin = _builtin_configs(kind)
    if name in builtin:
        return builtin[name]
    entry = getattr(registries(), kind).entries.get(name)
    return entry.config if entry is not None else None


def delta_checks() -> dict[str, Any]:
    """{name: factory} of the DiLoCo master's checks plugins registered (`register_delta_checks`)."""
    return {name: entry.factory for name, entry in registries().delta_checks.entries.items()}
