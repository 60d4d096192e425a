"""speedtronic-transformers: train any Hugging Face `transformers` causal-LM architecture with Speedtronic.

Registers the model "hf-causal-lm" (see plugin.py and model.py). Importing this package imports neither
torch nor transformers.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("speedtronic-transformers")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.0.0+unknown"
