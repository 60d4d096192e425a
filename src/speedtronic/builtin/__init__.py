"""The core's own plugins: the reference model, the optimizers and the logging hooks.

They are registered through exactly the hooks a third-party plugin implements, and import torch only
inside their factories. `builtin_registries()` gives the registries they fill on their own, without
loading any installed plugin: what the engine uses when it is handed no registries.
"""

from __future__ import annotations

import importlib

from speedtronic.registry import Registries

MODULES = (
    "speedtronic.builtin.models",
    "speedtronic.builtin.optimizers",
    "speedtronic.builtin.hooks",
)


def builtin_registries() -> Registries:
    """Fresh registries holding the built-in models, optimizers and hooks only."""
    registries = Registries()
    for module_name in MODULES:
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
