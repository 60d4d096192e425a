"""Initialise a model from a Hugging Face model folder: `model.init_from: PATH` (continued pretraining).

    model: {init_from: path/to/llama-folder, n_layer: 2, d_model: 64, n_head: 4, n_kv_head: 2, ...}

For the reference transformer the folder must hold a Llama (`model_type: llama`) whose config.json the
run's `model.*` fields match; the weights are renamed with the mapping in llama.py, in reverse, and
copied in as they are (so importing and exporting again gives the same bytes). A mismatch is a
ConfigError listing the `model.*` values to set. Plugin models that define
`load_hf_weights(tensors, hf_config, folder)` (e.g. hf-causal-lm) load any architecture they build.

Model building (engine/build.py `build_model_for`) calls `init_from_pretrained` once, right after the
model is instantiated and before it is sharded or wrapped, and not when the run resumes a checkpoint.
Weights are read from safetensors only (a single model.safetensors or a sharded index): a folder with
only pytorch_model.bin (a pickle) is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speedtronic.engine import llama
from speedtronic.errors import ConfigError

# Buffers some older Llama checkpoints carry; derived from the config, so safe to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model.init_from: {folder} is not a directory; point it at a Hugging Face model folder"
        )
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"model.init_from: {path} not found; a Hugging Face model folder has a config.json"
        ) from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"model.init_from: cannot read {path} ({error})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.init_from: {path} is not a JSON object")
    return config


def read_hf_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's model.safetensors, or of every shard its index names."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"model.init_from: cannot read {index} ({error})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
    elif (folder / "pytorch_model.bin").is_file():
        raise ConfigError(
            f"model.init_from: {folder} holds only pytorch_model.bin (a pickle, which speedtronic does not "
            "load); re-save it with transformers' save_pretrained(folder, safe_serialization=True)"
        )
    else:
        raise ConfigError(f"model.init_from: {folder} has no model.safetensors (or sharded index)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as error:  # safetensors raises its own error types for corrupt files
            raise ConfigError(f"model.init_from: cannot read {file} ({error})") from None
    return tensors


def init_from_pretrained(model: nn.Module, folder: str | Path) -> None:
    """Copy the weights of the Hugging Face folder into `model` (in place, before training)."""
    from speedtronic.engine.model import Transformer

    hf_config = read_hf_config(folder)
    if isinstance(model, Transformer):
        load_llama_weights(model, folder, hf_config)
        return
    loader = getattr(model, "load_hf_weights", None)
    if not callable(loader):
        raise ConfigError(
            f"model.init_from: {type(model).__name__} cannot load a Hugging Face folder; use the reference "
            "transformer (model.name: transformer) or a model with load_hf_weights (e.g. hf-causal-lm)"
        )
    with torch.no_grad():
        loader(read_hf_tensors(folder), hf_config, Path(folder))


def check_llama_config(model_cfg: Any, hf_config: dict[str, Any], folder: str | Path) -> None:
    """ConfigError unless our TransformerConfig `model_cfg` is exactly the Llama in `hf_config`."""
    problems = llama.unsupported_features(hf_config)
    if problems:
        raise ConfigError(
            f"model.init_from: {folder} is not a Llama the reference transformer implements: "
            + "; ".join(problems)
        )
    try:
        wanted = llama.model_fields(hf_config)
    except KeyError as error:
        raise ConfigError(f"model.init_from: {folder}/config.json lacks {error.args[0]!r}") from None
    ours = {
        "vocab_size": model_cfg.vocab_size,
        "n_layer": model_cfg.n_layer,
        "n_head": model_cfg.n_head,
        "n_kv_head": model_cfg.kv_heads,
        "d_model": model_cfg.d_model,
        "d_ff": model_cfg.ffn_dim,
        "tie_weights": model_cfg.tie_weights,
        "rope_base": float(model_cfg.rope_base),
        "norm_eps": float(model_cfg.norm_eps),
    }
    differ = [
        f"model.{key}: {json.dumps(wanted[key])} (is {json.dumps(ours[key])})"
        for key in wanted
        if wanted[key] != ours[key]
    ]
    if differ:
        raise ConfigError(
            f"model.init_from: the model does not match {folder}/config.json; set " + ", ".join(differ)
        )


def load_llama_weights(model: Any, folder: str | Path, hf_config: dict[str, Any] | None = None) -> None:
    """Rename a Llama folder's tensors to ours and copy them into the reference Transformer `model`."""
    hf_config = hf_config if hf_config is not None else read_hf_config(folder)
    check_llama_config(model.config, hf_config, folder)
    tensors = read_hf_tensors(folder)
    state: dict[str, torch.Tensor] = {}
    for hf_name, tensor in tensors.items():
        name = llama.from_hf_name(hf_name)
        if name is None:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            raise ConfigError(f"model.init_from: {folder} has tensor {hf_name}, which a Llama does not have")
        state[name] = tensor
    if model.config.tie_weights:
        # A tied folder stores the head once, as the embedding (it may repeat it as lm_head.weight).
        state["lm_head.weight"] = state.get("tok_emb.weight", state.get("lm_head.weight"))
    expected = model.state_dict()
    for name, ours in expected.items():
        tensor = state.get(name)
        hf_name = llama.to_hf_name(name)
        if tensor is None:
            raise ConfigError(f"model.init_from: {folder} lacks tensor {hf_name} (shape {list(ours.shape)})")
        if tensor.shape != ours.shape:
            raise ConfigError(
                f"model.init_from: {folder} tensor {hf_name} has shape {list(tensor.shape)}, the model "
                f"expects {list(ours.shape)}"
            )
    with torch.no_grad():
        model.load_state_dict(state, strict=True)
