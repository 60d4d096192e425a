"""The base of every config section: unknown keys are errors and a built section is frozen.

Its own module so that model configs (config/models.py, and any plugin's) can subclass it without
importing the whole schema. Never imports torch.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _numeric(annotation: Any) -> bool:
    """Whether a field's type is a number (int or float, optionally `| None`), not also a bool."""
    if annotation in (int, float):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = set(typing.get_args(annotation)) - {type(None)}
        return bool(args) and bool not in args and args <= {int, float}
    return False


class Section(BaseModel):
    """Base for every section: unknown keys are errors; a built config is frozen (copy to change it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `n_layer: true` as 1: in a config that is a typo, never a number.
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _numeric(field.annotation):
                raise ValueError(f"expected a number, got {str(value).lower()}")
        return value
