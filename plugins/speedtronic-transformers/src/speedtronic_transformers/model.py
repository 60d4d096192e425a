"""`hf-causal-lm`: any Hugging Face `transformers` causal-LM architecture, trained by the unchanged engine.

The architecture comes from `model.options`: a config file, inline fields, or both (inline wins):

    model:
      name: hf-causal-lm
      options:
        config: path/to/config.json     # a config.json, or a folder holding one (relative to the cwd)
        model_type: gpt2                # needed when there is no config file
        n_embd: 64                      # any field of that architecture's config class
        n_layer: 2

`vocab_size` is the run's `model.vocab_size` (by default the tokenizer's) unless the options set it.
The model is built with `AutoModelForCausalLM.from_config` (random init, seeded by `run.seed`); to start
from trained weights use `model.init_from: FOLDER` (a save_pretrained folder with safetensors).

`HFCausalLM` wraps the transformers model for the engine's contract (`speedtronic.hookspecs`):

* forward(input_ids, labels=None, attention_mask=None) -> {"logits", "loss"}. The data pipeline has
  already shifted the labels, while transformers models shift them again inside forward, so labels are
  never passed to the inner model: the loss is computed here on the unshifted logits.
* get_input_embeddings / get_output_embeddings delegate to the inner model, and both embedding modules
  carry `_speedtronic_optimizer_role = "adamw"`, so a hybrid Muon optimizer sends only hidden matrices
  (nn.Linear, and GPT-2's transformers.pytorch_utils.Conv1D) to Muon.
* set_gradient_checkpointing, export_hf (save_pretrained, for `speedtronic export`), load_hf_weights
  (for `model.init_from`).

The run's transformer fields (n_layer, d_model, n_head, ...) do not apply: setting one is an error
that points at model.options.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from speedtronic.engine.batches import causal_lm_loss
from torch import nn

if TYPE_CHECKING:
    from speedtronic.config import ModelConfig

# ModelConfig fields that describe the reference transformer; hf-causal-lm takes its shape from options.
_TRANSFORMER_FIELDS = (
    "n_layer",
    "n_head",
    "n_kv_head",
    "d_model",
    "d_ff",
    "rope_base",
    "norm_eps",
    "tie_weights",
    "dropout",
)
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length")


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the Speedtronic model contract (see the module docstring)."""

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model
        for module in (hf_model.get_input_embeddings(), hf_model.get_output_embeddings()):
            if module is not None:
                module._speedtronic_optimizer_role = "adamw"

    @property
    def config(self) -> Any:
        return self.hf_model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        logits = self.hf_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = causal_lm_loss(logits, labels)  # labels already shifted: no second shift
        return out

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module | None:
        return self.hf_model.get_output_embeddings()

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        if enabled:
            self.hf_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        else:
            self.hf_model.gradient_checkpointing_disable()

    def export_hf(self, folder: Path, dtype: torch.dtype | None = None) -> str:
        """Write config.json + model.safetensors (save_pretrained) into `folder`; returns the class name."""
        model = self.hf_model if dtype is None else self.hf_model.to(dtype)
        model.save_pretrained(str(folder), safe_serialization=True)
        return type(model).__name__

    def load_hf_weights(
        self, tensors: dict[str, torch.Tensor], hf_config: dict[str, Any], folder: Path
    ) -> None:
        """Copy a save_pretrained folder's tensors into the inner model (names must match exactly)."""
        if hf_config.get("model_type") != self.hf_model.config.model_type:
            raise ValueError(
                f"model.init_from: {folder} holds a {hf_config.get('model_type')!r} model, but model.options "
                f"build a {self.hf_model.config.model_type!r}"
            )
        own = self.hf_model.state_dict()
        missing = [name for name in own if name not in tensors]
        tied = {name for name in missing if _is_tied(self.hf_model, name)}
        missing = [name for name in missing if name not in tied]
        extra = [name for name in tensors if name not in own]
        if missing or extra:
            what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model does not"
            raise ValueError(
                f"model.init_from: {folder} {what}; build the same architecture in model.options"
            )
        for name, tensor in tensors.items():
            if tensor.shape != own[name].shape:
                raise ValueError(
                    f"model.init_from: {folder} tensor {name} has shape {list(tensor.shape)}, the model "
                    f"expects {list(own[name].shape)}; match the architecture in model.options"
                )
        self.hf_model.load_state_dict(tensors, strict=False)


def _is_tied(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` is the output head tied to the input embedding."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    return out is not None and inp is not None and out.weight is inp.weight and name.endswith("weight")


def hf_config_from_options(options: dict[str, Any], vocab_size: int | None) -> Any:
    """A transformers config from `model.options` (see the module docstring); ValueError naming a bad key."""
    from transformers import CONFIG_MAPPING, AutoConfig

    fields = dict(options)
    source = fields.pop("config", None)
    model_type = fields.pop("model_type", None)
    if source is not None:
        path = Path(str(source)).expanduser()
        if not path.exists():
            raise ValueError(
                f"model.options.config: {path} not found (a config.json or a folder holding one)"
            )
        config = AutoConfig.from_pretrained(str(path))
        if model_type is not None and model_type != config.model_type:
            raise ValueError(
                f"model.options.model_type {model_type!r} disagrees with {path} (model_type {config.model_type!r})"
            )
    elif model_type is None:
        raise ValueError(
            "hf-causal-lm needs model.options.config (a config.json path) or model.options.model_type"
        )
    elif model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"model.options.model_type {model_type!r} is not a transformers architecture{hint}")
    else:
        config = CONFIG_MAPPING[model_type]()
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    for key, value in fields.items():
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"model.options.{key} is not a field of the {config.model_type} config{hint}")
        setattr(config, key, value)
    if "vocab_size" not in fields and vocab_size is not None:
        config.vocab_size = vocab_size
        # e.g. GPT-2's 50256: special ids of the original vocabulary mean nothing in the run's one.
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value >= vocab_size:
                setattr(config, name, None)
    elif vocab_size is not None and config.vocab_size < vocab_size:
        raise ValueError(
            f"model.options.vocab_size ({config.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({vocab_size}); raise it or remove it"
        )
    return config


def build_hf_causal_lm(config: ModelConfig) -> HFCausalLM:
    """The registered factory's body: an HFCausalLM from the run's `model` section."""
    from speedtronic.config import ModelConfig as Defaults
    from transformers import AutoModelForCausalLM

    for name in _TRANSFORMER_FIELDS:
        if getattr(config, name) != Defaults.model_fields[name].default:
            raise ValueError(
                f"model.{name} does not apply to hf-causal-lm; set the architecture's own field in "
                "model.options instead (e.g. num_hidden_layers / n_layer, hidden_size / n_embd)"
            )
    hf_config = hf_config_from_options(config.options, config.vocab_size)
    context = next((getattr(hf_config, f) for f in _CONTEXT_FIELDS if getattr(hf_config, f, None)), None)
    if context is not None and config.max_seq_len is not None and context < config.max_seq_len:
        raise ValueError(
            f"the {hf_config.model_type} config allows {context} positions but model.max_seq_len (or "
            f"data.block_size) is {config.max_seq_len}; raise its max_position_embeddings / n_positions "
            "in model.options or lower data.block_size"
        )
    try:
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    except ValueError as error:  # e.g. a config class with no causal-LM head
        raise ValueError(f"hf-causal-lm: {str(error).splitlines()[0]}") from None
    return HFCausalLM(hf_model)
