"""The base of every config section: unknown keys are errors and a built section is frozen.

Its own module so that model configs (config/models.py, and any plugin's) can subclass it without
importing the whole schema. Never imports torch.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for every section: unknown keys are errors; a built config is frozen (copy to change it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
