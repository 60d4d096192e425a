"""Export a training checkpoint as a Hugging Face model folder (`speedtronic export CKPT OUT --format hf`).

    speedtronic export runs/shakespeare/checkpoints out/shakespeare-hf
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('out/shakespeare-hf')"

The folder holds:

    config.json             a LlamaForCausalLM config (reference transformer; mapping in engine/llama.py)
    model.safetensors       the weights under Llama names (a tied head is stored once, as
                            save_pretrained does), metadata {"format": "pt"}
    generation_config.json  the sampling settings `speedtronic sample` uses by default
    tokenizer.json,         the run's tokenizer: its own tokenizer.json (plus its tokenizer_config.json
    tokenizer_config.json   when one sits next to it), or for the byte tokenizer an equivalent byte-level
                            BPE (byte_tokenizer.py); none for synthetic-token runs
    README.md               a short model card (step, tokens, config)

Everything is checked before anything is written: a checkpoint whose tensors do not match the model its
stored config describes (a missing, extra or wrongly shaped tensor, a non-float or non-finite one, an
untied head in a tied config) is refused with a message naming the tensor, and no folder is created.

Plugin models can be exported too when the model has an `export_hf(folder, dtype)` method (the
speedtronic-transformers plugin's `hf-causal-lm` does: it calls transformers' save_pretrained).

Every file is written through atomic_files.py (a temp file renamed into place): an export cut short
leaves whole files or none, never a torn one.

Never unpickles anything but the checkpoint itself (through engine/checkpoint/files.py's weights-only load).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from speedtronic.atomic_files import atomic_write_bytes, atomic_write_path, atomic_write_text
from speedtronic.config import Config
from speedtronic.config.models import BaseModelConfig as ModelConfig
from speedtronic.engine import llama
from speedtronic.engine.checkpoint.layout import RunCheckpoint
from speedtronic.errors import CheckpointError, ConfigError, SpeedtronicError
from speedtronic.interop.byte_tokenizer import write_byte_tokenizer
from speedtronic.plan import RunPlan
from speedtronic.registry import Registries

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What `speedtronic sample` does by default; an exported folder carries it in generation_config.json.
DEFAULT_GENERATION = {"do_sample": True, "temperature": 0.8, "top_k": None, "max_new_tokens": 200}


def export_hf(
    checkpoint: str | Path,
    outdir: str | Path,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the Hugging Face folder for `checkpoint` (a file or a checkpoint directory) into `outdir`.

    `dtype` is float32 | bfloat16 | float16 (default: the checkpoint's own). Returns a JSON-able summary.
    """

    outdir = Path(outdir)
    _check_request(outdir, dtype, overwrite)

    from speedtronic.engine.checkpoint.load_run import load_run
    from speedtronic.plugins import registries

    # The one way back from a checkpoint: its config, its plan (vocabulary, context) and tokenizer.
    run = load_run(checkpoint, build_model=False)
    source, config, plan, tokenizer = run.checkpoint.path, run.config, run.plan, run.tokenizer
    assert source is not None
    model_cfg = plan.model_config(config.model)
    state: dict[str, torch.Tensor] = run.checkpoint.part("model")

    from speedtronic.builtin.models import TransformerModelConfig

    # The reference transformer's layout maps onto Llama's here; any other model exports itself.
    if isinstance(model_cfg, TransformerModelConfig):
        tensors, hf_cfg, parameters = _llama_tensors(source, model_cfg, state, dtype)
        eos = tokenizer.eos_id if not config.data.synthetic else None
        hf_cfg.update(bos_token_id=None, eos_token_id=eos)
        outdir.mkdir(parents=True, exist_ok=True)
        _save_safetensors(tensors, outdir / "model.safetensors")
        _write_json(outdir / "config.json", hf_cfg)
        architecture = "LlamaForCausalLM"
    else:
        architecture, parameters = _export_plugin_model(source, model_cfg, registries(), state, outdir, dtype)
        eos = tokenizer.eos_id if not config.data.synthetic else None

    generation = {**DEFAULT_GENERATION, "eos_token_id": eos, "pad_token_id": eos}
    _write_json(outdir / "generation_config.json", generation)
    tokenizer_files = _export_tokenizer(config, tokenizer, outdir, max_len=plan.max_seq_len)
    card = _model_card(config, plan, run.checkpoint, architecture)
    atomic_write_text(outdir / "README.md", card)
    return {
        "format": "hf",
        "checkpoint": str(source),
        "output": str(outdir),
        "step": run.checkpoint.step,
        "architecture": architecture,
        "parameters": parameters,
        "tokenizer": tokenizer_files[0] if tokenizer_files else None,
        "files": sorted(p.name for p in outdir.iterdir()),
    }


def _check_request(outdir: Path, dtype: str | None, overwrite: bool) -> None:
    """Usage mistakes (exit 2), found before anything is read or written."""
    if outdir.exists() and not outdir.is_dir():
        raise ConfigError(  # --overwrite writes into a folder; it never replaces a file by one
            f"{outdir} is a file, not a folder; pick a folder to export into"
        )
    if outdir.exists() and any(outdir.iterdir()) and not overwrite:
        raise ConfigError(  # nothing in it is touched
            f"{outdir} already exists and is not empty; pick a new folder or pass --overwrite"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")


# ------------------------------------------------------------------------------ reference transformer


def _llama_tensors(
    source: Path, model_cfg_in: ModelConfig, state: dict[str, torch.Tensor], dtype: str | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    """Checked, renamed, contiguous tensors + config.json for the reference transformer."""
    from speedtronic.engine.build import instantiate_model

    # The model the stored plan describes, on the meta device: its shapes without allocating it.
    with torch.device("meta"):
        expected_model = instantiate_model(model_cfg_in)
    model_cfg = expected_model.config
    expected = {name: tuple(t.shape) for name, t in expected_model.state_dict().items()}
    fields = (
        f"n_layer={model_cfg.n_layer}, d_model={model_cfg.d_model}, n_head={model_cfg.n_head}, "
        f"n_kv_head={model_cfg.kv_heads}, d_ff={model_cfg.ffn_dim}, vocab_size={model_cfg.vocab_size}"
    )
    missing = [name for name in expected if name not in state]
    if missing:
        raise CheckpointError(
            f"{source}: tensor {missing[0]} (shape {list(expected[missing[0]])}) is missing"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the stored config ({fields}) "
            "needs it. The checkpoint is incomplete or was edited: export another step_*.pt"
        )
    extra = [name for name in state if name not in expected]
    if extra:
        raise CheckpointError(
            f"{source}: tensor {extra[0]} is not part of the model its config describes ({fields}); "
            "the checkpoint and its config disagree: export another step_*.pt"
        )
    for name, shape in expected.items():
        tensor = state[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {list(tensor.shape)} but the stored config ({fields}) "
                f"implies {list(shape)}; the checkpoint and its config disagree: export another step_*.pt"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: tensor {name} has dtype {tensor.dtype}, not a float type")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(
                f"{source}: tensor {name} holds NaN or inf values (the run diverged); export an earlier step"
            )
    if model_cfg.tie_weights and not torch.equal(state["lm_head.weight"], state["tok_emb.weight"]):
        raise CheckpointError(
            f"{source}: model.tie_weights is true but lm_head.weight differs from tok_emb.weight; "
            "the checkpoint and its config disagree"
        )

    target = DTYPES[dtype] if dtype else state["tok_emb.weight"].dtype
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and model_cfg.tie_weights:
            continue  # stored once, as model.embed_tokens.weight (tie_word_embeddings: true)
        hf_name = llama.to_hf_name(name)
        if hf_name is None:  # every state_dict name of the reference model maps; a new one must be added
            raise CheckpointError(f"{source}: tensor {name} has no LlamaForCausalLM counterpart")
        tensors[hf_name] = tensor.detach().to(device="cpu", dtype=target).contiguous()
    hf_cfg = llama.hf_config(model_cfg, dtype=str(target).removeprefix("torch."), bos_id=None, eos_id=None)
    parameters = sum(t.numel() for t in tensors.values())
    return tensors, hf_cfg, parameters


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `path` atomically, with the permissions any new file gets (safetensors alone creates it
    owner-only, and in place)."""
    from safetensors.torch import save_file

    # transformers refuses a safetensors file without format metadata.
    atomic_write_path(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))


# ------------------------------------------------------------------------------------- plugin models


def _export_plugin_model(
    source: Path,
    model_cfg: ModelConfig,
    registries: Registries,
    state: dict[str, torch.Tensor],
    outdir: Path,
    dtype: str | None,
) -> tuple[str, int]:
    from speedtronic.engine.build import instantiate_model

    model = instantiate_model(model_cfg, registries)
    exporter = getattr(model, "export_hf", None)
    if not callable(exporter):
        raise SpeedtronicError(
            f"model.name {model_cfg.name!r} cannot be exported to Hugging Face format: only the reference "
            "transformer and models with an export_hf(folder, dtype) method (e.g. hf-causal-lm) can"
        )
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        first = str(error).splitlines()[1:2] or [str(error)]
        raise CheckpointError(
            f"{source}: the weights do not fit the model its config describes ({first[0].strip()})"
        ) from None
    outdir.mkdir(parents=True, exist_ok=True)
    architecture = exporter(outdir, DTYPES[dtype] if dtype else None)
    return str(architecture), sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------- tokenizer, card


def _export_tokenizer(config: Config, tokenizer: Any, outdir: Path, max_len: int) -> list[str]:
    from speedtronic.engine.data import ByteTokenizer

    if config.data.synthetic:
        return []  # synthetic token ids are not text: there is nothing to tokenize
    if isinstance(tokenizer, ByteTokenizer):
        return write_byte_tokenizer(outdir, model_max_length=max_len)
    source = Path(tokenizer.path)  # HFTokenizer: the tokenizer.json the run used
    atomic_write_bytes(outdir / "tokenizer.json", source.read_bytes())
    written = ["tokenizer.json"]
    # Keep the original's special-token setup when it sits next to the tokenizer.json.
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (source.parent / name).is_file():
            atomic_write_bytes(outdir / name, (source.parent / name).read_bytes())
            written.append(name)
    if "tokenizer_config.json" not in written:
        tok_config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_len,
            "clean_up_tokenization_spaces": False,
        }
        if tokenizer.eos_id is not None:
            tok_config["eos_token"] = tokenizer._tok.id_to_token(tokenizer.eos_id)
        _write_json(outdir / "tokenizer_config.json", tok_config)
        written.append("tokenizer_config.json")
    return written


def _model_card(config: Config, plan: RunPlan, checkpoint: RunCheckpoint, architecture: str) -> str:
    m = config.model
    tokens = (checkpoint.part("counters") or {}).get("tokens_seen", 0)
    return (
        f"# {config.run.name}\n\n"
        f"A {architecture} trained with Speedtronic and exported with "
        "`speedtronic export --format hf`.\n\n"
        f"- step {checkpoint.step}, {tokens:,} training tokens\n"
        f"- model `{m.name}`: n_layer {m.n_layer}, d_model {m.d_model}, n_head {m.n_head}, "
        f"n_kv_head {m.n_kv_head or m.n_head}, context {plan.max_seq_len}, vocabulary {plan.vocab_size:,}\n"
        f"- tokenizer: {plan.tokenizer or 'byte (token id = UTF-8 byte)'}\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
        'model = AutoModelForCausalLM.from_pretrained("PATH")\n'
        'tokenizer = AutoTokenizer.from_pretrained("PATH")\n```\n'
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))
