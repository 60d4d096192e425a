"""The plugin module speedtronic loads (entry point `speedtronic: transformers = "speedtronic_transformers.plugin"`).

register_models: "hf-causal-lm", any transformers causal-LM architecture built from a config (model.py).

Kept light: speedtronic imports it for every command, `--help` included, so transformers and torch are
imported by the factory, when a run builds the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speedtronic import hookimpl

if TYPE_CHECKING:
    from speedtronic.config import ModelConfig
    from speedtronic.hookspecs import Register

MODEL_NAME = "hf-causal-lm"


def hf_causal_lm_factory(config: ModelConfig) -> Any:
    from speedtronic_transformers.model import build_hf_causal_lm  # torch + transformers, on first use

    return build_hf_causal_lm(config)


@hookimpl
def register_models(register: Register) -> None:
    register(MODEL_NAME, hf_causal_lm_factory)
