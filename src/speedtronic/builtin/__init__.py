"""The core's own plugins: the reference model, the optimizers and the logging hooks.

They are registered through exactly the hooks a third-party plugin implements, and import torch only
inside their factories.
"""
