"""Which bus backend serves a run URL: a registry keyed by URL scheme.

    file://PATH            DirectoryBus (a local disk or a shared mount)
    s3://BUCKET/PREFIX     S3Bus (AWS S3, R2, MinIO, Hugging Face Storage Buckets' S3 gateway)
    owner/name             HubBus (a Hugging Face Hub repo; also hf://owner/name)

Backends are registered as "module:Class" strings, imported only when a URL of theirs is opened, so
naming one never imports huggingface_hub or boto3. Built-ins are registered below; a plugin adds
one through the `register_buses(register)` hook (speedtronic.hookspecs), e.g.
`register("gs", "my_plugin.bus:GcsBus")`. This module imports no backend: no import circle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from speedtronic.diloco.bus.base import Bus
from speedtronic.errors import ConfigError

if TYPE_CHECKING:
    from speedtronic.config.distributed import DistributedConfig

# The built-in backends: adding one is its module plus one line here.
BUILTIN_BACKENDS: dict[str, str] = {
    "file": "speedtronic.diloco.bus.directory:DirectoryBus",
    "hub": "speedtronic.diloco.bus.hub:HubBus",
    "s3": "speedtronic.diloco.bus.s3:S3Bus",
}
_extra: dict[str, Any] = {}


def register_bus(scheme: str, backend: Any) -> None:
    """Serve `scheme://…` URLs with `backend` (a Bus subclass or a "module:Class" string)."""
    _extra[scheme] = backend


def backends() -> dict[str, Any]:
    """Every scheme a URL may use, built-in and registered by plugins."""
    return {**BUILTIN_BACKENDS, **_plugin_backends(), **_extra}


def _plugin_backends() -> dict[str, Any]:
    try:
        from speedtronic.plugins import bus_backends
    except ImportError:
        return {}
    return bus_backends()


def scheme_of(url: str) -> str:
    """`s3://b/p` → "s3", `file://x` → "file", `owner/name` or `hf://owner/name` → "hub"."""
    if "://" in url:
        scheme = url.split("://", 1)[0].lower()
        return "hub" if scheme == "hf" else scheme
    return "hub"


def _load(target: Any, scheme: str) -> type[Bus]:
    if isinstance(target, str):
        module, _, name = target.partition(":")
        target = getattr(importlib.import_module(module), name)
    if not (isinstance(target, type) and issubclass(target, Bus)):
        raise ConfigError(f"bus backend for {scheme}:// is {target!r}, not a Bus subclass")
    return target


def open_bus(
    url: str,
    *,
    config: DistributedConfig | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    **settings: Any,
) -> Bus:
    """The bus for a run URL (see the module docstring). `config` is the `distributed` section;
    `settings` override a backend's client settings (e.g. retry_budget_s for a status check)."""
    scheme = scheme_of(url)
    table = backends()
    if scheme not in table:
        known = ", ".join(f"{s}://" for s in sorted(table) if s != "hub")
        raise ConfigError(f"--repo {url!r}: no bus for {scheme}://; use owner/name (the Hub), {known}")
    backend = _load(table[scheme], scheme)
    return backend.from_url(url, config=config, endpoint=endpoint, token=token, **settings)
