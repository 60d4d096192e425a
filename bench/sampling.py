"""Sampling speed: tokens/s with the KV cache against full-context decoding, for short and long outputs.

    OMP_NUM_THREADS=2 python bench/sampling.py [--rounds 3] [--prompt 64] [--short 64] [--long 448]
        [--n-layer 4] [--d-model 256] [--context 512] [--device cpu]

The model is the reference transformer (seeded random weights, fp32, eval mode) with a `--context`
token window, so `--prompt` + `--long` = 512 fills it exactly. Two arms decode greedily from the same
random prompt, through `Transformer.generate`:

- `cached`: `use_cache=True`, the prompt prefilled once, then one token per forward;
- `full`: `use_cache=False`, the whole context re-run for every new token (the pre-cache behaviour).

Each arm and length is warmed up once, then the four runs take turns for `--rounds` rounds (the machine
is shared: alternating spreads the noise). Printed: the median tokens/s of each, the ratio long/short
per arm (with a cache it should be near 1: each step costs about the same; without, it falls because
every step re-reads a longer context) and the cached/full speed-up per length. It also checks that
both arms produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from speedtronic.engine.model import Transformer, TransformerConfig


def rate(model: Transformer, prompt: torch.Tensor, new: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    """(new tokens per second, the tokens) for one greedy generation."""
    start = time.perf_counter()
    out = model.generate(prompt, new, temperature=0.0, use_cache=use_cache)
    if out.is_cuda:
        torch.cuda.synchronize()
    return new / (time.perf_counter() - start), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    parser.add_argument("--short", type=int, default=64, help="new tokens of the short run")
    parser.add_argument("--long", type=int, default=448, help="new tokens of the long run")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--context", type=int, default=512, help="the model's max_seq_len")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = TransformerConfig(
        vocab_size=256,
        max_seq_len=args.context,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
    )
    model = Transformer(config).to(args.device).eval()
    prompt = torch.randint(0, 256, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(
        args.device
    )
    runs = [(arm, new) for new in (args.short, args.long) for arm in ("cached", "full")]
    print(
        f"model {args.n_layer}x{args.d_model} ({model.num_parameters():,} parameters), context {args.context}, "
        f"prompt {args.prompt} tokens, greedy, fp32, {args.device}, {torch.get_num_threads()} threads, "
        f"{args.rounds} rounds"
    )

    outputs: dict[tuple[str, int], torch.Tensor] = {}
    for arm, new in runs:  # warm-up (allocator, kernels)
        _, outputs[arm, new] = rate(model, prompt, new, arm == "cached")
    rates: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    for _ in range(args.rounds):
        for arm, new in runs:
            tps, _ = rate(model, prompt, new, arm == "cached")
            rates[arm, new].append(tps)
    median = {run: statistics.median(values) for run, values in rates.items()}

    for arm, new in runs:
        print(f"  {arm:6s} {new:4d} new tokens: {median[arm, new]:9.1f} tokens/s")
    for arm in ("cached", "full"):
        ratio = median[arm, args.long] / median[arm, args.short]
        print(f"  {arm:6s} tokens/s ratio {args.long}/{args.short}: {ratio:.2f}")
    for new in (args.short, args.long):
        print(
            f"  speed-up cached/full at {new} new tokens: {median['cached', new] / median['full', new]:.1f}x"
        )
    same = all(torch.equal(outputs["cached", new], outputs["full", new]) for new in (args.short, args.long))
    print(f"  same greedy tokens cached and full: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
