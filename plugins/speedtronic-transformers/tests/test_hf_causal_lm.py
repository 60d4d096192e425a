"""hf-causal-lm: transformers architectures built from a config and trained by the unchanged engine.

Needs the plugin installed (`pip install -e plugins/speedtronic-transformers`; CI does it): tests that
need the entry point fail, rather than skip, when it is missing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from speedtronic import Trainer
from speedtronic.config import ModelConfig, load_config

from speedtronic_transformers.model import HFCausalLM, build_hf_causal_lm

transformers = pytest.importorskip("transformers")

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def gpt2_config_file(folder: Path) -> Path:
    transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=256, bos_token_id=0, eos_token_id=0
    ).save_pretrained(folder)
    return folder / "config.json"


def train_config(tmp_path: Path, options: dict[str, Any], steps: int = 12) -> Any:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200, encoding="utf-8")
    return load_config(
        {
            "run": {
                "device": "cpu",
                "max_steps": steps,
                "log_every": 1,
                "eval_every": 0,
                "output_dir": str(tmp_path / "run"),
            },
            "model": {"name": "hf-causal-lm", "options": options},
            # Byte tokenizer on a small text: a tiny model's loss falls fast and far from ln(256).
            "data": {"text_path": str(text), "block_size": 32, "micro_batch_size": 8, "val_batches": 1},
            "optimizer": {"name": "adamw", "lr": 1e-2},
            "precision": {"mode": "fp32"},
            "checkpoint": {"enabled": False},
            "logging": {"hooks": ["jsonl"]},
        }
    )


def losses(config: Any) -> list[float]:
    lines = Path(config.metrics_file()).read_text().splitlines()
    return [
        json.loads(line)["loss"]
        for line in lines
        if '"loss"' in line and json.loads(line).get("loss") is not None
    ]


def require_installed() -> None:
    if importlib.util.find_spec("speedtronic_transformers") is None or not any(
        ep.value == "speedtronic_transformers.plugin" for ep in metadata.entry_points(group="speedtronic")
    ):
        pytest.fail(
            "speedtronic-transformers is not installed: pip install -e plugins/speedtronic-transformers"
        )


@pytest.mark.parametrize("arch", ["llama-inline", "gpt2-config-file"])
def test_a_tiny_model_trains_through_the_engine(tmp_path: Path, arch: str) -> None:
    require_installed()  # the Trainer finds hf-causal-lm through the entry point
    options = TINY_LLAMA if arch == "llama-inline" else {"config": str(gpt2_config_file(tmp_path / "gpt2"))}
    config = train_config(tmp_path, options)
    trainer = Trainer(config, progress=False)
    inner = trainer.raw_model.hf_model
    assert type(inner).__name__ == ("LlamaForCausalLM" if arch == "llama-inline" else "GPT2LMHeadModel")
    assert inner.config.vocab_size == 256  # filled from the run's tokenizer
    result = trainer.train()
    seen = losses(config)
    assert result.steps == 12 and len(seen) == 12
    print(f"{arch}: loss {seen[0]:.3f} -> {seen[-1]:.3f}")
    assert seen[-1] < seen[0] - 0.5, seen


def test_labels_are_not_shifted_twice() -> None:
    torch.manual_seed(0)
    model = build_hf_causal_lm(
        ModelConfig(name="hf-causal-lm", vocab_size=50, max_seq_len=16, options=TINY_LLAMA)
    )
    ids = torch.randint(0, 50, (2, 16))
    labels = torch.randint(0, 50, (2, 16))
    out = model(ids, labels=labels)
    # The data pipeline already shifted: position t is scored against labels[t].
    expected = F.cross_entropy(out["logits"].reshape(-1, 50), labels.reshape(-1))
    torch.testing.assert_close(out["loss"], expected)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"options": {**TINY_LLAMA, "hiden_size": 8}},
            r"model.options.hiden_size .*did you mean 'hidden_size'",
        ),
        (
            {"options": {"model_type": "lama"}},
            r"'lama' is not a transformers architecture \(did you mean 'llama'",
        ),
        ({"options": {"num_hidden_layers": 2}}, "needs model.options.config .* or model.options.model_type"),
        ({"options": TINY_LLAMA, "n_layer": 8}, "model.n_layer does not apply to hf-causal-lm"),
        ({"options": TINY_LLAMA, "max_seq_len": 128}, "allows 64 positions but model.max_seq_len"),
        ({"options": {**TINY_LLAMA, "vocab_size": 10}}, r"vocab_size \(10\) is smaller than the tokenizer's"),
        ({"options": {"config": "no/such/config.json"}}, "no/such/config.json not found"),
    ],
)
def test_bad_options_are_errors_naming_the_key(model: dict[str, Any], message: str) -> None:
    config = ModelConfig(
        name="hf-causal-lm", vocab_size=50, max_seq_len=model.pop("max_seq_len", 32), **model
    )
    with pytest.raises(ValueError, match=message):
        build_hf_causal_lm(config)


def test_export_and_init_from_round_trip_through_save_pretrained(tmp_path: Path) -> None:
    require_installed()
    from speedtronic.engine.checkpoint.layout import write_checkpoint
    from speedtronic.interop.hf_export import export_hf

    config = train_config(tmp_path, {"config": str(gpt2_config_file(tmp_path / "gpt2"))})
    trainer = Trainer(config, progress=False)
    write_checkpoint(tmp_path / "ckpt", trainer.checkpoint(), keep_last=None)
    result = export_hf(tmp_path / "ckpt", tmp_path / "out")
    assert result["architecture"] == "GPT2LMHeadModel"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.raw_model.eval()(ids)["logits"])
    # `speedtronic sample` on the folder (through transformers: not a Llama) continues like the run's model.
    from speedtronic.engine.decoding import SamplingSettings
    from speedtronic.engine.sampling import SamplingFlags, generate_tokens
    from speedtronic.interop.hf_folder import sample_folder

    flags = SamplingFlags(max_new_tokens=5, temperature=0)
    _, settings = sample_folder(tmp_path / "out", prompt="the ", flags=flags)
    prompt = torch.tensor([list(b"the ")])
    expected = generate_tokens(
        trainer.raw_model, prompt, SamplingSettings(5, temperature=0.0), max_seq_len=32
    )
    assert settings["token_ids"] == expected[0, 4:].tolist() and settings["tokens"] == 5
    # ... and a new run initialised from that folder starts from exactly those weights.
    again = load_config(
        {
            **config.model_dump(mode="json"),
            "model": {**config.model.model_dump(), "init_from": str(tmp_path / "out")},
            "run": {**config.run.model_dump(), "seed": 99},
        }
    )
    fresh = Trainer(again, progress=False)
    for (name, a), b in zip(
        trainer.raw_model.state_dict().items(), fresh.raw_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_muon_routing_sends_only_hidden_matrices_to_muon() -> None:
    routing = pytest.importorskip("speedtronic.optim.routing")
    from transformers.pytorch_utils import Conv1D

    for options in (
        TINY_LLAMA,
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
    ):
        model = build_hf_causal_lm(
            ModelConfig(name="hf-causal-lm", vocab_size=64, max_seq_len=32, options=options)
        )
        routes = routing.route_parameters(model).names()
        hidden = {
            f"{module_name}.weight"
            for module_name, module in model.named_modules()
            if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not model.get_output_embeddings()
        }
        assert set(routes["muon"]) == hidden, options["model_type"]
        for name in routes["adamw"]:
            assert name not in hidden
        adamw = set(routes["adamw"])
        assert any("embed_tokens" in n or "wte" in n for n in adamw)
        assert all(
            ("norm" in n or "ln_" in n or n.endswith("bias"))
            or "emb" in n
            or "wte" in n
            or "wpe" in n
            or "lm_head" in n
            for n in adamw
        ), adamw
        names = {n for n, _ in model.named_parameters()}
        assert set(routes["muon"]) | adamw == names


def test_importing_the_plugin_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, speedtronic_transformers.plugin\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import at load time'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_module_wraps_and_tags_the_embeddings() -> None:
    model = build_hf_causal_lm(
        ModelConfig(name="hf-causal-lm", vocab_size=64, max_seq_len=32, options=TINY_LLAMA)
    )
    assert isinstance(model, HFCausalLM)
    assert model.get_output_embeddings() is model.hf_model.lm_head
    assert model.get_input_embeddings()._speedtronic_optimizer_role == "adamw"
    assert model.get_output_embeddings()._speedtronic_optimizer_role == "adamw"
