"""speedtronic-example: a third-party Speedtronic plugin to copy.

It adds a GRU language model ("example-gru") and a CSV metrics hook ("csv"); speedtronic finds it through
the `speedtronic` entry point that points at `speedtronic_example.plugin`. Importing this package
imports neither torch nor speedtronic.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("speedtronic-example")  # one source of truth: pyproject.toml
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.0.0+unknown"
