"""The Python API end to end: a config, a Trainer with a model of your own, a resume, and sampling.

    python examples/train_reference.py                      # ~1 minute on 2 CPU cores
    python examples/train_reference.py --steps 8 --out /tmp/ref --json   # seconds (what the test runs)

1. the config: a shipped one (`shakespeare`: its text ships inside the package) with overrides, exactly
   as `--set` gives them on the command line;
2. a model of your own: any `nn.Module` whose `forward(input_ids)` returns logits trains, with the
   config's data, optimizer, schedule, checkpoints and metrics (`Trainer(config, model=...)`);
3. a resume: the first Trainer stops half-way (`train(max_steps=...)`, a checkpoint is saved), and a
   second one, built the same way, continues from that checkpoint to the end of the run;
4. sampling: the trained model continues a prompt (`speedtronic.engine.sampling.generate_tokens`, what
   `speedtronic sample` runs; a model without a KV cache of its own is run over the whole context).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from speedtronic import Trainer, load_config
from speedtronic.engine.data import ByteTokenizer
from speedtronic.engine.decoding import SamplingSettings
from speedtronic.engine.sampling import generate_tokens


class TinyGRU(nn.Module):
    """A byte-level GRU language model: the smallest model that learns something in a minute."""

    def __init__(self, vocab_size: int = 256, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(input_ids))
        return self.head(hidden)  # logits (batch, time, vocab): the trainer computes the loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="run.max_steps (default 200)")
    parser.add_argument("--out", default="runs/train-reference", help="the run's output directory")
    parser.add_argument("--prompt", default="ROMEO:", help="what the trained model continues")
    parser.add_argument("--json", action="store_true", help="end with one JSON object on stdout")
    args = parser.parse_args(argv)

    # 1. The config: every --set of the command line is an override here.
    overrides = [
        "run.name=train-reference",
        f"run.output_dir={args.out}",
        f"run.max_steps={args.steps}",
        f"run.log_every={max(1, args.steps // 8)}",
        "run.eval_every=0",
        f"checkpoint.every_steps={max(1, args.steps // 2)}",
        "data.block_size=64",
        "data.micro_batch_size=8",
        "data.val_batches=2",
        "optimizer.lr=3e-3",
        "scheduler.warmup_steps=0",
    ]
    config = load_config("shakespeare", overrides)

    # 2 and 3. Train half the run, stop (a checkpoint is saved), then resume with a second Trainer.
    half = max(1, args.steps // 2)
    first = Trainer(config, model=TinyGRU(), progress=False).train(max_steps=half)
    model = TinyGRU()
    second = Trainer(config, model=model, progress=False).train()  # resumes: a checkpoint exists
    if second.resumed_from is None:
        raise SystemExit("the second Trainer did not resume from the first one's checkpoint")

    # 4. Sample from the trained model.
    tokenizer = ByteTokenizer()
    ids = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    generator = torch.Generator().manual_seed(1337)
    model.eval()
    settings = SamplingSettings(max_new_tokens=80, temperature=0.8)
    out = generate_tokens(model, ids, settings, max_seq_len=config.data.block_size, generator=generator)
    text = tokenizer.decode(out[0, ids.shape[1] :].tolist())

    summary = {
        "first_steps": first.steps,
        "resumed_from": second.resumed_from,
        "steps": second.steps,
        "loss": second.final_loss,
        "checkpoint": second.checkpoint,
        "prompt": args.prompt,
        "sample": text,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"trained {first.steps} steps, resumed from {second.resumed_from} to step {second.steps}")
        print(f"loss {second.final_loss:.4f} · checkpoint {second.checkpoint}")
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
