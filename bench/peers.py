"""Throughput against a peer: `speedtronic train` vs the Hugging Face Trainer on an equivalent Llama.

    pip install -e ".[bench]"      # transformers + accelerate, for this script only
    python bench/peers.py [--steps 40] [--d-model 256] [--layers 4] [--batch 16] [--seq 256]

Both sides train the same architecture (our reference transformer is a Llama: RMSNorm, RoPE,
SwiGLU, tied embeddings), the same dims, batch, sequence, optimizer (AdamW, same betas, decay and
clip) and schedule on windows of the embedded tinyshakespeare corpus:

- ours: the `speedtronic train` command with its automatic defaults (precision, fused kernels, …),
  run as a subprocess; its JSON `tokens_per_s` excludes evaluation, checkpoints and compilation;
- HF: `transformers.Trainer` on `LlamaForCausalLM` (sdpa attention), at its default (fp32) and at
  its best setting (`bf16=True`); tokens/s over the steps after a warm-up, timed by a callback.

The HF runs and ours alternate in one process tree on the same machine; ratios are printed last and
as one JSON line. Goals: ≥ 2.4× HF's default and ≥ 1.5× HF's bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def ours(args: argparse.Namespace, extra_sets: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        config = Path(out) / "peer.yaml"
        config.write_text(
            json.dumps(
                {
                    "run": {
                        "name": "peer",
                        "max_steps": args.steps,
                        "log_every": 10,
                        "eval_every": 0,
                        "output_dir": out,
                    },
                    "model": {
                        "n_layer": args.layers,
                        "n_head": args.heads,
                        "d_model": args.d_model,
                        "dropout": 0.0,
                    },
                    "data": {"block_size": args.seq, "micro_batch_size": args.batch, "val_batches": 0},
                    "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.1, "grad_clip": 1.0},
                    "scheduler": {"name": "cosine", "warmup_steps": 2},
                    "checkpoint": {"enabled": False},
                    "logging": {"hooks": []},
                }
            )
        )
        sets = [item for s in extra_sets for item in ("--set", s)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
        }
        result = subprocess.run(
            [sys.executable, "-m", "speedtronic", "train", str(config), "--json", *sets],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if result.returncode:
            raise SystemExit(f"speedtronic train failed:\n{result.stderr[-2000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])


def hf(args: argparse.Namespace, bf16: bool) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from speedtronic.engine.data.text import read_default_corpus_bytes

    d_ff = ((int(8 / 3 * args.d_model) + 63) // 64) * 64  # our SwiGLU default, see engine/model.py
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.d_model,
        intermediate_size=d_ff,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    corpus = torch.frombuffer(bytearray(read_default_corpus_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(0)
    count = args.steps * args.batch
    starts = torch.randint(0, corpus.numel() - args.seq - 1, (count,), generator=generator).tolist()
    dataset = [{"input_ids": corpus[s : s + args.seq], "labels": corpus[s : s + args.seq]} for s in starts]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.times.append(time.perf_counter())

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            max_steps=args.steps,
            learning_rate=3e-4,
            weight_decay=0.1,
            adam_beta1=0.9,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            lr_scheduler_type="cosine",
            warmup_steps=2,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            bf16=bf16,
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        Trainer(model=model, args=training, train_dataset=dataset, callbacks=[clock]).train()
    warm = args.warmup
    elapsed = clock.times[-1] - clock.times[warm - 1]
    return (len(clock.times) - warm) * args.batch * args.seq / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="HF steps left out of the timing")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra --set for our run")
    args = parser.parse_args()

    hf_fp32 = hf(args, bf16=False)
    print(f"HF Trainer fp32        {hf_fp32:10,.0f} tok/s", flush=True)
    hf_bf16 = hf(args, bf16=True)
    print(f"HF Trainer bf16        {hf_bf16:10,.0f} tok/s", flush=True)
    report = ours(args, args.sets)
    print(
        f"speedtronic train      {report['tokens_per_s']:10,.0f} tok/s  (precision {report['precision']}, "
        f"compiled {report['compiled']}, compile {report['compile_s'] or 0:.1f} s)"
    )
    result = {
        "hf_fp32_tokens_per_s": hf_fp32,
        "hf_bf16_tokens_per_s": hf_bf16,
        "ours_tokens_per_s": report["tokens_per_s"],
        "ours_precision": report["precision"],
        "ours_compiled": report["compiled"],
        "ratio_vs_hf_fp32": report["tokens_per_s"] / hf_fp32,
        "ratio_vs_hf_bf16": report["tokens_per_s"] / hf_bf16,
    }
    print(
        f"ratio vs HF fp32 {result['ratio_vs_hf_fp32']:.2f} (goal ≥ 2.4) · vs HF bf16 {result['ratio_vs_hf_bf16']:.2f} (goal ≥ 1.5)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
