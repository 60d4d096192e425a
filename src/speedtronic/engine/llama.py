"""The mapping between our reference Transformer (engine/model.py) and Hugging Face `LlamaForCausalLM`.

Our model was written to be a Llama, so the mapping is names only, no reshaping:

    ours                                   LlamaForCausalLM
    tok_emb.weight                         model.embed_tokens.weight
    blocks.{i}.norm1.weight                model.layers.{i}.input_layernorm.weight
    blocks.{i}.attn.{q,k,v,o}_proj.weight  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    blocks.{i}.norm2.weight                model.layers.{i}.post_attention_layernorm.weight
    blocks.{i}.mlp.{gate,up,down}_proj.weight  model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                            model.norm.weight
    lm_head.weight                         lm_head.weight (only when untied)

Why no tensor needs changing:

* RoPE layout. Both use the "rotate-half" convention: channel i of a head's first half is paired with
  channel i + head_dim/2, at frequency rope_base^(-2i/head_dim). (Meta's original checkpoints pair
  *adjacent* channels and HF's conversion script permutes the q/k rows to rotate-half; ours already
  are, so q_proj/k_proj rows are copied as they are, with no permutation either way.)
* GQA. k_proj/v_proj have n_kv_head * head_dim rows in both; query head h uses kv head
  h // (n_head / n_kv_head) in both (our repeat_interleave / SDPA enable_gqa == HF's repeat_kv).
* Tied head. `tie_weights: true` <-> `tie_word_embeddings: true`; the folder then stores only
  model.embed_tokens.weight (as `save_pretrained` does) and the head is rebuilt from it on load.
* Norms. Same RMSNorm (x / sqrt(mean(x^2) + eps) * weight, no bias); eps is `model.norm_eps` <->
  `rms_norm_eps`. Attention scale 1/sqrt(head_dim) in both; no biases anywhere
  (attention_bias = mlp_bias = false); MLP act silu.

Config fields: vocab_size <-> vocab_size, d_model <-> hidden_size, n_layer <-> num_hidden_layers,
n_head <-> num_attention_heads, n_kv_head <-> num_key_value_heads, ffn_dim <-> intermediate_size,
max_seq_len <-> max_position_embeddings, rope_base <-> rope_theta, norm_eps <-> rms_norm_eps.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import re
from typing import Any

# Per-layer parameter names: ours (after "blocks.{i}.") -> HF (after "model.layers.{i}.").
_LAYER_NAMES = {
    "norm1.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "norm2.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_OURS_LAYER = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_LAYER_NAMES = {hf: ours for ours, hf in _LAYER_NAMES.items()}
_HF_GLOBAL_NAMES = {hf: ours for ours, hf in _GLOBAL_NAMES.items()}


def to_hf_name(name: str) -> str | None:
    """Our parameter name -> the LlamaForCausalLM name; None for a name with no counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _OURS_LAYER.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def from_hf_name(name: str) -> str | None:
    """A LlamaForCausalLM parameter name -> ours; None for a name with no counterpart."""
    if name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[name]
    match = _HF_LAYER.fullmatch(name)
    if match and match.group(2) in _HF_LAYER_NAMES:
        return f"blocks.{match.group(1)}.{_HF_LAYER_NAMES[match.group(2)]}"
    return None


def hf_config(model: Any, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict[str, Any]:
    """config.json for a LlamaForCausalLM equivalent to our `TransformerConfig` `model`."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "max_position_embeddings": model.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": model.norm_eps,
        # transformers 5 reads rope_parameters, 4.x reads rope_theta; each ignores the other's key.
        "rope_theta": model.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_base},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": model.tie_weights,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": dtype,
    }


def rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)


def unsupported_features(config: dict[str, Any]) -> list[str]:
    """Parts of a Llama config.json our Transformer does not implement (empty when it maps exactly)."""
    problems = []
    if config.get("model_type") != "llama":
        problems.append(f"model_type is {config.get('model_type')!r}, not 'llama'")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act is {config['hidden_act']!r} (ours is silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            problems.append(f"{flag} is true (ours has no biases)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type != "default":
        problems.append(f"rope type is {rope_type!r} (ours is plain RoPE)")
    if config.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp is {config['pretraining_tp']}")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        problems.append(f"head_dim ({head_dim}) * num_attention_heads ({heads}) != hidden_size ({hidden})")
    return problems


def model_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The `model.*` settings (our ModelConfig field names) that a Llama config.json implies."""
    heads = config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"],
        "n_layer": config["num_hidden_layers"],
        "n_head": heads,
        "n_kv_head": config.get("num_key_value_heads") or heads,
        "d_model": config["hidden_size"],
        "d_ff": config["intermediate_size"],
        "tie_weights": bool(config.get("tie_word_embeddings", False)),  # LlamaConfig default
        "rope_base": rope_theta(config),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
    }
