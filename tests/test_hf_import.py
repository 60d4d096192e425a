"""`model.init_from`: a Hugging Face Llama folder initialises the reference transformer (continued
pretraining), and exporting it again gives the same bytes; folders it cannot represent are refused.

The source folders are written by transformers' own `save_pretrained` (random tiny Llamas).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.engine.checkpoint.layout import write_checkpoint
from speedtronic.errors import ConfigError
from speedtronic.interop.hf_export import export_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

SEQ = 32


def llama_folder(folder: Path, *, tie: bool, kv_heads: int, **extra: Any) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
        **extra,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))  # norms away from 1 too
    model.save_pretrained(folder)
    return folder


def run_config(tmp_path: Path, source: Path, **model: Any) -> Any:
    fields = {
        "init_from": str(source),
        "n_layer": 2,
        "d_model": 64,
        "n_head": 4,
        "d_ff": 160,
        "rope_base": 5000.0,
        "norm_eps": 1e-5,
        **model,
    }
    return load_config(
        {
            "run": {"device": "cpu", "output_dir": str(tmp_path / "run")},
            "model": fields,
            "data": {"block_size": SEQ, "micro_batch_size": 2, "val_batches": 1},
            "logging": {"hooks": []},
        }
    )


@pytest.mark.parametrize(("tie", "kv_heads"), [(True, 4), (False, 2)], ids=["tied-mha", "untied-gqa"])
def test_import_then_export_is_bitwise(tmp_path: Path, tie: bool, kv_heads: int) -> None:
    from safetensors.torch import load_file

    source = llama_folder(tmp_path / "src", tie=tie, kv_heads=kv_heads)
    config = run_config(tmp_path, source, tie_weights=tie, n_kv_head=kv_heads)
    trainer = Trainer(config, progress=False)  # what `speedtronic train` builds before step 0

    # The initialised model computes what the source computes.
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        diff = (trainer.raw_model.eval()(ids)["logits"] - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4

    write_checkpoint(tmp_path / "ckpt", trainer.checkpoint(), keep_last=None)
    export_hf(tmp_path / "ckpt", tmp_path / "out")
    original, exported = (
        load_file(str(source / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (source, tmp_path / "out"))
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "tie_word_embeddings",
        "vocab_size",
        "rope_parameters",
    ):
        assert out_cfg[key] == src_cfg[key], key


def test_init_from_is_skipped_when_resuming(tmp_path: Path) -> None:
    source = llama_folder(tmp_path / "src", tie=True, kv_heads=4)
    config = run_config(tmp_path, source, tie_weights=True)
    trainer = Trainer(config, progress=False)
    with torch.no_grad():
        trainer.raw_model.norm.weight.fill_(3.0)  # "trained" away from the source
    trainer.counters.step = 5
    trainer.save()
    resumed = Trainer(config, progress=False)
    assert resumed.resumed_from is not None
    assert torch.equal(resumed.raw_model.norm.weight, torch.full((64,), 3.0))


def test_a_mismatched_model_config_lists_the_fields_to_set(tmp_path: Path) -> None:
    source = llama_folder(tmp_path / "src", tie=False, kv_heads=2)
    config = run_config(tmp_path, source, n_layer=4, d_ff=None)  # tie and kv heads left at our defaults
    with pytest.raises(ConfigError) as error:
        Trainer(config, progress=False)
    message = str(error.value)
    assert "model.init_from" in message
    for expected in (
        "model.n_layer: 2 (is 4)",
        "model.n_kv_head: 2 (is 4)",
        "model.d_ff: 160 (is 192)",
        "model.tie_weights: false (is true)",
    ):
        assert expected in message, message


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"attention_bias": True}, "attention_bias is true"), ({"hidden_act": "gelu"}, "hidden_act is 'gelu'")],
)
def test_a_llama_the_reference_model_cannot_represent_is_refused(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    source = llama_folder(tmp_path / "src", tie=True, kv_heads=4, **extra)
    with pytest.raises(ConfigError, match=message):
        Trainer(run_config(tmp_path, source, tie_weights=True), progress=False)


def test_pickle_only_and_missing_folders_are_refused(tmp_path: Path) -> None:
    source = llama_folder(tmp_path / "src", tie=True, kv_heads=4)
    (source / "model.safetensors").rename(source / "pytorch_model.bin")  # only its name matters here
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin .*safe_serialization=True"):
        Trainer(run_config(tmp_path, source, tie_weights=True), progress=False)
    with pytest.raises(ConfigError, match="is not a directory"):
        Trainer(run_config(tmp_path, tmp_path / "nowhere", tie_weights=True), progress=False)
