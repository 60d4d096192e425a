"""The run's two JSON documents on the bus, typed: `manifest.json` (what every node must agree on) and
`head.json` (the master's latest publish).

Both are read from a bus that may be hostile, so each has one parser (`Manifest.parse`, `HeadDoc.parse`)
that validates what the readers rely on — types, signs, shapes — and turns anything else into one
clear error naming the file and the field, never a traceback deep inside a role. Fields a reader does
not know are kept as they are (a newer master may add some), so a document read and written back loses
nothing. The writers still build plain dicts (diloco/manifest.py, the master's publish); `to_json`
gives the same dict back.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from speedtronic.diloco import codec
from speedtronic.errors import PermissionDenied, SpeedtronicError

__all__ = [
    "Collaborator",
    "DocumentError",
    "FragmentRounds",
    "HeadDoc",
    "Manifest",
    "ParamEntry",
    "RunInfo",
    "epoch_of",
    "not_listed",
]


class DocumentError(SpeedtronicError):
    """A manifest or head that does not parse: the message names the file and the field."""


class _Document(BaseModel):
    # Unknown fields are kept (a newer writer's), known ones are checked strictly: "abc" is no int.
    model_config = ConfigDict(extra="allow", frozen=True, strict=False)


MAX_ELEMENTS = 1 << 40  # a parameter tensor larger than this is no model's: a tampered manifest


class ParamEntry(_Document):
    shape: list[int]
    dtype: str = Field(min_length=1, max_length=32)

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        if any(d < 0 for d in shape) or len(shape) > 8:
            raise ValueError("a shape is at most 8 non-negative dimensions")
        if math.prod(shape) > MAX_ELEMENTS:
            raise ValueError(f"a tensor of more than {MAX_ELEMENTS:,} elements")
        return shape

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, dtype: str) -> str:
        if (
            not isinstance(getattr(torch, dtype, None), torch.dtype)
            or not getattr(torch, dtype).is_floating_point
        ):
            raise ValueError("not a floating-point torch dtype (float32, bfloat16, float16)")
        return dtype


class Collaborator(_Document):
    user: str | None = None
    delta_repo: str | None = None
    added_at: str | None = None


class RunInfo(_Document):
    """manifest.json "run": the settings every node must share. Older manifests lack some fields."""

    name: str | None = None
    model: dict[str, Any] = Field(default_factory=dict)
    block_size: int | None = Field(default=None, gt=0)
    max_steps: int | None = Field(default=None, ge=0)
    inner_steps: int | None = Field(default=None, gt=0)
    outer_steps: int | None = Field(default=None, gt=0)
    outer_lr: float | None = Field(default=None, allow_inf_nan=False)
    outer_momentum: float | None = Field(default=None, allow_inf_nan=False)
    delta_codec: str | None = None
    tokens_per_step: int | None = Field(default=None, gt=0)
    max_delta_tokens: int | None = Field(default=None, gt=0)
    fragments: dict[str, Any] | None = None

    @field_validator("delta_codec")
    @classmethod
    def _codec(cls, name: str | None) -> str | None:
        if name is not None and name not in codec.CODECS:
            raise ValueError(f"not a delta codec ({', '.join(codec.CODECS)})")
        return name


class Manifest(_Document):
    """manifest.json: format, fingerprint, parameter specs, the run's settings and its collaborators."""

    format: int
    kind: str
    fingerprint: str = ""
    params: dict[str, ParamEntry] = Field(default_factory=dict)
    run: RunInfo = Field(default_factory=RunInfo)
    collaborators: dict[str, Collaborator] = Field(default_factory=dict)
    created_at: str | None = None

    @field_validator("collaborators")
    @classmethod
    def _node_ids(cls, collaborators: dict[str, Collaborator]) -> dict[str, Collaborator]:
        bad = [node for node in collaborators if not codec.NODE_RE.match(node)]
        if bad:
            raise ValueError(f"invalid node id {bad[0][:70]!r} (letters, digits, . _ - only)")
        return collaborators

    @classmethod
    def parse(cls, raw: object, where: str = "manifest.json") -> Manifest:
        manifest: Manifest = _parse(cls, raw, where)
        # The fingerprint is what nodes compare; the specs are what they decode with: one edited
        # without the other would pass the check and then misread every file.
        edited = manifest.fingerprint and manifest.params
        if edited and codec.fingerprint(manifest.specs()) != manifest.fingerprint:
            raise DocumentError(
                f"{where}: field fingerprint is invalid (it is not the fingerprint of params: the "
                "manifest was edited); restore the run's manifest.json"
            )
        return manifest

    def lists(self, node: str) -> bool:
        """Whether `node` may send deltas: it is listed, or the run lists nobody (open to everyone)."""
        return not self.collaborators or node in self.collaborators

    def specs(self) -> dict[str, codec.ParamSpec]:
        return {name: codec.ParamSpec(tuple(p.shape), p.dtype) for name, p in self.params.items()}

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class FragmentRounds(_Document):
    """head.json "fragments" (Streaming DiLoCo): how many, and each one's round."""

    count: int = Field(gt=0)
    rounds: list[int]


class FinalPick(_Document):
    """head.json "final": the run is over; which global its master published as the final one."""

    outer_step: int = Field(ge=0)
    val_loss: float | None = None
    chosen: str | None = None

    def describe(self) -> str:
        loss = "" if self.val_loss is None else f", val loss {self.val_loss:.4f}"
        return f"outer step {self.outer_step}{loss}"


class HeadDoc(_Document):
    """head.json: the outer step the named global is at, per-node high-water marks and the report."""

    format: int | None = None
    outer_step: int = Field(ge=-1)
    updated_at: str | None = None
    global_: str | None = Field(default=None, alias="global")
    # The global's int8 update from the global of outer step update_from (global_update.py), if sent.
    update: str | None = None
    update_from: int | None = Field(default=None, ge=-1)
    global_updates: bool | None = None  # the master sends updates: a worker keeps the global it fetched
    hwm: dict[str, int] = Field(default_factory=dict)
    nodes: dict[str, Any] = Field(default_factory=dict)
    applied_total: int | None = Field(default=None, ge=0)
    rejected: dict[str, int] = Field(default_factory=dict)
    rejected_ids: list[str] = Field(default_factory=list)
    epoch: int | None = None
    fragments: FragmentRounds | None = None
    status: dict[str, Any] | None = None
    final: FinalPick | None = None  # present once the run is over: its master stopped

    @classmethod
    def parse(cls, raw: object, where: str = "head.json") -> HeadDoc:
        return _parse(cls, raw, where)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _parse(cls: type[Any], raw: object, where: str) -> Any:
    if not isinstance(raw, dict):
        raise DocumentError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    try:
        return cls.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(document)"
        value = repr(first.get("input"))[:60]
        raise DocumentError(f"{where}: field {field} is invalid ({first['msg']}; found {value})") from None


def not_listed(url: str, node: str, removed: bool = False) -> PermissionDenied:
    """The one refusal of a node the manifest does not list (the Hub's wording): at start, or once
    the owner removed it while it ran."""
    what = "was removed from this run's collaborators" if removed else "is not a collaborator of this run"
    return PermissionDenied(
        f"{url}: node {node!r} {what} (manifest.json); the owner adds it with "
        f"`speedtronic hub add-collaborator {url} {node}`"
    )


def epoch_of(document: object) -> int:
    """The fencing epoch of a head (0 when absent: a head written before epochs, or by `hub init`)."""
    value = document.get("epoch") if isinstance(document, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
