"""Sampling from a Hugging Face model folder (`speedtronic sample OUTDIR`), honouring generation_config.json.

A Llama folder that the reference transformer implements (every folder `speedtronic export` writes for it)
is loaded into our own Transformer through the import mapping: no `transformers` needed. Any other
architecture is loaded with `transformers.AutoModelForCausalLM` (installed with the `hf` extra).

Settings come from the command line when given, else from generation_config.json, else the defaults of
`speedtronic sample` (see `resolve_generation`), into one `SamplingSettings`. Honoured there: do_sample (false: greedy), temperature,
top_k, top_p, repetition_penalty, max_new_tokens (or max_length minus the prompt) and eos_token_id
(generation stops once the sequence has produced one; it is not part of the returned text). Other fields
(beams, other penalties) are listed as ignored in the result, not silently dropped.

The decoding loop is the checkpoints' one (engine/sampling.py `run_sampling`): a folder loaded into our
Transformer decodes with its KV cache; a transformers model is re-run over the whole context per token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from speedtronic.engine.decoding import SamplingSettings
from speedtronic.errors import ConfigError, SpeedtronicError

if TYPE_CHECKING:
    from speedtronic.engine.sampling import Sampled, SamplingFlags

_DEFAULTS = SamplingSettings()  # `speedtronic sample`'s defaults, where neither flag nor file says
_HONOURED = {
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "max_new_tokens",
    "max_length",
    "eos_token_id",
}
# Fields that are present in most generation configs but change nothing for plain sampling.
_NEUTRAL = {"bos_token_id", "pad_token_id", "transformers_version", "_from_model_config", "use_cache"}
_NEUTRAL_VALUES = {"num_beams": 1, "min_p": None, "typical_p": 1.0}


def is_hf_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise SpeedtronicError(f"cannot read {path} ({error}); fix or delete it") from None
    if not isinstance(data, dict):
        raise SpeedtronicError(f"{path} is not a JSON object; fix or delete it")
    return data


@dataclass(frozen=True)
class FolderSampling:
    """What a folder is sampled with: the settings, the ids that end the text, the fields not honoured."""

    settings: SamplingSettings
    eos_ids: list[int]
    ignored: list[str]

    def report(self) -> dict[str, Any]:
        """The `generation` object of `speedtronic sample --json` (before the tokens are added)."""
        s = self.settings
        return {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "repetition_penalty": s.repetition_penalty,
            "eos_token_id": self.eos_ids,
            "ignored": self.ignored,
        }


def _from_generation_config(generation: dict[str, Any], prompt_len: int) -> dict[str, Any]:
    """generation_config's sampling fields as `SamplingSettings` keywords, our defaults where it has none."""
    if generation.get("do_sample") is False:
        temperature = 0.0  # greedy
    else:
        temperature = float(generation.get("temperature", _DEFAULTS.temperature))
    if generation.get("max_new_tokens") is not None:
        max_new_tokens = int(generation["max_new_tokens"])
    elif generation.get("max_length") is not None:
        max_new_tokens = max(0, int(generation["max_length"]) - prompt_len)
    else:
        max_new_tokens = _DEFAULTS.max_new_tokens
    top_p = generation.get("top_p")
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_k": generation.get("top_k") or None,  # 0 and null both mean "no top-k"
        "top_p": None if top_p is None else float(top_p),
        "repetition_penalty": float(generation.get("repetition_penalty") or _DEFAULTS.repetition_penalty),
    }


def resolve_generation(
    generation: dict[str, Any], prompt_len: int, flags: SamplingFlags | None = None
) -> FolderSampling:
    """The settings to sample with: command-line values, then generation_config, then our defaults.
    ValueError naming the setting when the result is out of range."""
    from speedtronic.engine.sampling import SamplingFlags

    values = {**_from_generation_config(generation, prompt_len), **(flags or SamplingFlags()).given()}
    if values["top_p"] is not None and values["top_p"] >= 1.0:
        values["top_p"] = None  # 1.0 keeps every token: the same as no top-p
    eos = generation.get("eos_token_id")
    ignored = sorted(
        key
        for key, value in generation.items()
        if key not in _HONOURED | _NEUTRAL and _NEUTRAL_VALUES.get(key, object()) != value
    )
    return FolderSampling(
        SamplingSettings(**values),
        eos_ids=sorted({eos} if isinstance(eos, int) else set(eos or [])),
        ignored=ignored,
    )


class _Logits(nn.Module):
    """A transformers model seen as ids -> logits (so its own generate() is not used)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def load_folder_model(folder: str | Path) -> tuple[nn.Module, int]:
    """(model in eval mode on CPU, context length) for a Hugging Face folder."""
    from speedtronic.engine import llama
    from speedtronic.engine.pretrained import load_llama_weights, read_hf_config

    config = read_hf_config(folder)
    context = int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)
    if not llama.unsupported_features(config):
        from speedtronic.engine.model import Transformer, TransformerConfig

        fields = llama.model_fields(config)
        model = Transformer(TransformerConfig(max_seq_len=context, **fields))
        load_llama_weights(model, folder, config)
        return model.eval(), context
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise SpeedtronicError(
            f"{folder} holds a {config.get('model_type')!r} model, which needs transformers: "
            "pip install 'speedtronic-lm[hf]'"
        ) from None
    return _Logits(AutoModelForCausalLM.from_pretrained(str(folder))).eval(), context


def load_folder_tokenizer(folder: str | Path) -> Any:
    from speedtronic.engine.data import ByteTokenizer, HFTokenizer
    from speedtronic.interop.byte_tokenizer import is_byte_tokenizer

    if is_byte_tokenizer(folder):
        return ByteTokenizer()
    if not (Path(folder) / "tokenizer.json").is_file():
        raise SpeedtronicError(
            f"{folder} has no tokenizer.json, so a text prompt cannot be encoded (a synthetic-token export?)"
        )
    return HFTokenizer(folder)


def sample_folder(
    folder: str | Path,
    *,
    prompt: str,
    flags: SamplingFlags | None = None,
    device: str = "cpu",
    on_text: Callable[[str], None] | None = None,
) -> tuple[Sampled, dict[str, Any]]:
    """(continuation with timings, settings used) for `prompt` from the model in the Hugging Face `folder`.

    `repetition_window` (llama.cpp's repeat_last_n), `window_refill` and the seed have no
    generation_config field: flags only."""
    from speedtronic.engine.device import resolve_device
    from speedtronic.engine.sampling import run_sampling

    tokenizer = load_folder_tokenizer(folder)
    model, context = load_folder_model(folder)
    model = model.to(resolve_device(device))
    prompt_ids = tokenizer.encode(prompt) or [0]
    try:
        chosen = resolve_generation(read_generation_config(folder), len(prompt_ids), flags)
    except ValueError as error:
        raise ConfigError(f"{Path(folder) / 'generation_config.json'} or the flags: {error}") from None
    sampled = run_sampling(
        model,
        tokenizer.decode,
        prompt_ids,
        chosen.settings,
        max_seq_len=context,
        eos_ids=chosen.eos_ids,
        on_text=on_text,
    )
    report = chosen.report()
    report["tokens"], report["token_ids"] = len(sampled.token_ids), sampled.token_ids
    return sampled, report
