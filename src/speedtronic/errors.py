"""Exception types that carry a user-facing message and a process exit code.

The CLI turns each into one readable line on stderr and the matching exit code; library
callers can catch them by type. Messages must never contain secrets.
"""

from __future__ import annotations


class SpeedtronicError(Exception):
    """A failure with a message fit to show a user as-is (exit code 1)."""

    exit_code: int = 1


class ConfigError(SpeedtronicError, ValueError):
    """Invalid configuration or usage: the message names the field or file and the fix (exit 2).

    Also a ValueError, so code that validates values (pydantic validators, `except ValueError`
    around a model factory) treats a bad value the same way whichever of the two it raises."""

    exit_code = 2


class CheckpointError(SpeedtronicError):
    """A checkpoint that is missing, truncated, corrupt or unsafe to load (exit 1)."""


class PathNotFound(CheckpointError, ConfigError):
    """A checkpoint path the user named does not exist: a usage mistake (exit 2), and a CheckpointError."""


class DataError(SpeedtronicError):
    """A dataset or tokenizer that cannot be read as configured (exit 1)."""


class DataPathError(DataError, ConfigError):
    """A data path in the config that does not exist or is not a regular file: a config mistake
    (exit 2, the field named), and a DataError for callers that catch data failures."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class BusError(SpeedtronicError):
    """A sync-bus or Hub operation failed for good (after retries, or for a reason retrying cannot fix)."""


class TransientBusError(BusError):
    """A failure worth retrying later (server error, timeout, connection refused, rate limit)."""


class PermissionDenied(BusError):
    """The credentials cannot do what the run needs; the message names the repo and the permission."""
