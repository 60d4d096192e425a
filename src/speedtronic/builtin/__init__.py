"""The core's own plugins: the reference model, the optimizers and the logging hooks.

They are registered through exactly the hooks a third-party plugin implements, and import torch only
inside their factories. speedtronic.registry names these modules; the plugin host loads them by
name like any installed plugin; `speedtronic.registry.builtin_registries()` gives the registries they
fill on their own.
"""
