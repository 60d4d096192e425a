"""Optimizer sections: `OptimizerConfig` (the built-in optimizers' section, and the base every
optimizer's typed config extends) and how an `optimizer:` mapping finds its class.

As with models (config/models.py), an optimizer may be registered with its own config class,
`register("name", factory, config=Cls)` with Cls a subclass of `OptimizerConfig`: the `optimizer:`
section of a run is then validated by Cls, so a plugin optimizer's settings are typed fields with
defaults and rules, errors name the dotted field (`optimizer.momentum`), and its factory receives a
Cls. An optimizer registered without one, and a name nobody registered, get `OptimizerConfig`.

This module never imports torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from speedtronic.config.registered import registered_class, resolve_registered
from speedtronic.config.section import Section
from speedtronic.registry import Registries

DEFAULT_OPTIMIZER = "adamw"

MuonPlusMode = Literal["row", "col", "row_col", "col_row"]


class OptimizerConfig(Section):
    """The `optimizer:` section of the built-in optimizers; a plugin optimizer's typed config extends it."""

    name: str = Field(
        "adamw", min_length=1, description="adamw | muon | muon_plus, or one a plugin registers."
    )
    lr: float = Field(
        3e-4, gt=0, description="Peak learning rate (after warm-up); also the Muon route's base."
    )
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW moment coefficients, each in [0, 1).")
    eps: float = Field(1e-8, gt=0, description="AdamW denominator epsilon.")
    weight_decay: float = Field(
        0.1, ge=0, description="Decoupled weight decay of matrices; vectors (norms, biases) are not decayed."
    )
    fused: bool | None = Field(None, description="Fused AdamW kernel (default: when the device supports it).")
    grad_clip: float | None = Field(1.0, ge=0, description="Max global grad norm (0 or null: no clipping).")
    cautious: bool = Field(
        False, description="Cautious variant: only move where the update agrees with the gradient."
    )
    muon_plus: bool | MuonPlusMode = Field(
        False, description="Muon+: normalise the update's rows/columns after orthogonalising (true = col)."
    )
    muon_lr: float | None = Field(
        None, gt=0, description="Learning rate of the Muon route (default: lr, see muon_adjust_lr)."
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon momentum (EMA coefficient).")
    muon_nesterov: bool = Field(True, description="Nesterov look-ahead on the Muon momentum.")
    muon_ns_steps: int = Field(5, gt=0, lt=100, description="Newton-Schulz iterations.")
    muon_ns_schedule: Literal["keller", "polar_express"] = Field(
        "keller", description="Newton-Schulz coefficients: fixed (keller) or per-iteration (polar_express)."
    )
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw",
        description="Muon LR scale per matrix: 0.2*sqrt(max(A,B)) so optimizer.lr serves both routes, "
        "or sqrt(max(1,A/B)) (Keller Jordan's; then set muon_lr around 0.02).",
    )
    muon_norm_eps: float = Field(
        1e-7, gt=0, description="Floor of the norms Newton-Schulz and Muon+ divide by."
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _muon_fields(self) -> OptimizerConfig:
        # Compare with the defaults rather than model_fields_set so a full dump loads back unchanged.
        muon_fields = sorted(
            name
            for name, field in type(self).model_fields.items()
            if name.startswith("muon_")
            and getattr(self, name) != field.get_default(call_default_factory=True)
        )
        if self.name == "adamw" and muon_fields:
            raise ValueError(
                f"{', '.join('optimizer.' + f for f in muon_fields)} only apply to a Muon optimizer; "
                "set optimizer.name to muon or "
                "muon_plus, or remove them"
            )
        return self


def optimizer_config_class(name: Any, registries: Registries | None = None) -> type[OptimizerConfig]:
    """The config class registered for optimizer `name` in `registries` (None: the built-ins, then the
    installed plugins); `OptimizerConfig` when the optimizer declared none or nobody registered it."""
    return registered_class("optimizers", name, OptimizerConfig, registries)


def resolve_optimizer_section(value: Any, registries: Registries | None = None) -> OptimizerConfig:
    """An `optimizer:` section (mapping, optimizer config or a bare name) validated by its optimizer's
    class; a section validated by another class (loaded without these registries) is validated again."""
    return resolve_registered(
        value,
        kind="optimizers",
        family=OptimizerConfig,
        fallback=OptimizerConfig,
        default_name=DEFAULT_OPTIMIZER,
        registries=registries,
    )


def validate_optimizer_field(value: Any, info: ValidationInfo) -> OptimizerConfig:
    """The `optimizer` field's validator: the registries to resolve the class from come in the validation
    context (`{"registries": ...}`), else the default lookup."""
    return resolve_optimizer_section(value, (info.context or {}).get("registries"))
