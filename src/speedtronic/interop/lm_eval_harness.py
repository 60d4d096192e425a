"""The LM Evaluation Harness on a speedtronic checkpoint: a registered `lm_eval` model, `speedtronic`.

`SpeedtronicLM` is an `lm_eval.api.model.LM` over a checkpoint's model and tokenizer (rebuilt by
engine/checkpoint/load_run.py's `load_run`, so a file or a checkpoint folder, sharded ones too), scored with the
same batched primitive as `speedtronic eval` (engine/eval/evaluate.py), so a harness task and a
speedtronic task file agree on what a log-likelihood is:

* `loglikelihood`: (context, continuation) -> (summed log-probability, greedy would produce it); the
  continuation's tokens are those of context+continuation after the context's own (the harness's
  split), contexts longer than the window keep their end.
* `loglikelihood_rolling`: a whole text's log-probability, in windows of the model's context (the
  tokenizer's EOS first as context when it has one, so every token is scored; without one the first
  token is context only), which the harness turns into word/byte perplexity and bits per byte.
* `generate_until`: greedy decoding (engine/decoding.py), stopped at the first `until` string or
  `max_gen_toks` tokens; sampling settings in gen_kwargs are refused (one clear line), the harness's
  standard tasks decode greedily.

Use: `speedtronic eval CKPT --harness TASKS` (cli/eval_cmd.py), `run_harness` below, or lm_eval's
own API with `model=SpeedtronicLM.from_checkpoint(path)` / `model="speedtronic"` after importing this
module. `lm_eval` is the optional `lm-eval` extra: importing this module without it is an ImportError
naming it (the CLI checks first: interop/__init__.py's `require_lm_eval`, exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speedtronic.errors import ConfigError

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as _error:  # pragma: no cover - only without the extra
    raise ImportError(
        "the lm-eval extra is not installed: pip install 'speedtronic-lm[lm-eval]' (or pip install lm_eval)"
    ) from _error

import torch

from speedtronic.engine.eval.evaluate import _fit, _split_pair, score


@register_model("speedtronic")
class SpeedtronicLM(LM):
    """A speedtronic model and tokenizer as the harness sees a model (see the module doc)."""

    def __init__(
        self,
        checkpoint: str | None = None,
        device: str = "cpu",
        batch_size: int | str = 16,
        *,
        model: Any = None,
        tokenizer: Any = None,
        max_seq_len: int | None = None,
        **_ignored: Any,  # the harness passes its own settings (max_batch_size, …) to every model
    ) -> None:
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ConfigError(
                    "model speedtronic: give checkpoint=PATH (a step_*.pt or checkpoint folder)"
                )
            from speedtronic.engine.checkpoint.load_run import load_run
            from speedtronic.plugins import registries

            run = load_run(checkpoint, device=device, registries=registries())
            model, tokenizer, max_seq_len = run.model, run.tokenizer, run.plan.max_seq_len
        if tokenizer is None or max_seq_len is None:
            raise ConfigError("SpeedtronicLM: give a checkpoint, or model with tokenizer and max_seq_len")
        self.model, self.tok, self.max_seq_len = model, tokenizer, int(max_seq_len)
        # "auto" is the harness's batch-size search; a fixed size is as good for models this size.
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 16
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str = "cpu", batch_size: int = 16) -> SpeedtronicLM:
        return cls(str(path), device=device, batch_size=batch_size)

    @property
    def eot_token_id(self) -> int | None:
        return getattr(self.tok, "eos_id", None)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tok, "spec", type(self.tok).__name__))

    # -- the three request types ------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        sequences: list[list[int]] = []
        starts: list[int] = []
        for request in requests:
            context, continuation = request.args[0], request.args[1]
            ctx, cont = _split_pair(self.tok, context, continuation)
            if not ctx:  # an empty context: the EOS (or the continuation's first token) is the context
                eos = self.eot_token_id
                ctx, cont = ([eos], cont) if eos is not None else (cont[:1], cont[1:])
            if not cont:  # nothing to score (an empty continuation): log-probability 0, greedy
                sequences.append([])
                starts.append(0)
                continue
            seq, start = _fit(ctx, cont, self.max_seq_len)
            sequences.append(seq)
            starts.append(start)
        real = [i for i, s in enumerate(sequences) if s]
        scored = score(
            self.model, [sequences[i] for i in real], [starts[i] for i in real], batch_size=self.batch_size
        )
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)
        for i, s in zip(real, scored, strict=True):
            out[i] = (s.logprob, s.greedy)
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        eos = self.eot_token_id
        windows: list[list[int]] = []
        owners: list[int] = []
        for number, request in enumerate(requests):
            tokens = ([eos] if eos is not None else []) + list(self.tok.encode(request.args[0]))
            # Windows overlap by one token: the last target of one is the first input of the next.
            for start in range(0, len(tokens) - 1, self.max_seq_len):
                windows.append(tokens[start : start + self.max_seq_len + 1])
                owners.append(number)
        totals = [0.0] * len(requests)
        scored = score(self.model, windows, [1] * len(windows), batch_size=self.batch_size)
        for number, s in zip(owners, scored, strict=True):
            totals[number] += s.logprob
        return totals

    @torch.no_grad()
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from speedtronic.engine.decoding import SamplingSettings, stream_tokens

        out: list[str] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for request in requests:
                context, settings = request.args[0], dict(request.args[1] or {})
                until = settings.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                limit = int(settings.pop("max_gen_toks", 64))
                if settings.pop("do_sample", False) or float(settings.pop("temperature", 0.0) or 0.0) > 0:
                    raise ConfigError(
                        "model speedtronic: generate_until decodes greedily; drop do_sample/temperature "
                        "from the task's generation_kwargs"
                    )
                ids = list(self.tok.encode(context)) or [self.eot_token_id or 0]
                ids = ids[-self.max_seq_len :]
                prompt = torch.tensor([ids], dtype=torch.long, device=self._device)
                made: list[int] = []
                text = ""
                greedy = SamplingSettings(max_new_tokens=limit, temperature=0.0)
                for token in stream_tokens(self.model, prompt, greedy, max_seq_len=self.max_seq_len):
                    value = int(token[0, 0])
                    if value == self.eot_token_id:
                        break
                    made.append(value)
                    text = self.tok.decode(made)
                    if any(stop in text for stop in until):
                        break
                for stop in until:  # the harness expects the text before the first stop sequence
                    text = text.split(stop)[0]
                out.append(text)
        finally:
            self.model.train(was_training)
        return out


def run_harness(
    lm: SpeedtronicLM,
    tasks: list[str],
    *,
    include: list[str] = (),  # type: ignore[assignment]
    limit: int | None = None,
    num_fewshot: int | None = None,
) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` on `lm`: {"results": {task: {metric: value}}, "versions", "n-shot",
    "n_samples"} (the harness's report, without the per-sample logs and the config dump).
    `include` adds folders of task YAML files (the harness's --include_path)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    for folder in include:
        if not Path(folder).is_dir():
            raise ConfigError(f"--harness-include {folder}: not a folder (one of task YAML files)")
    manager = TaskManager(include_path=list(include) or None)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        raise ConfigError(
            f"--harness: unknown task(s) {', '.join(unknown)}; see `lm_eval ls tasks`, or add a folder of task "
            "YAML files with --harness-include"
        )
    report = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        log_samples=False,
        # Means (acc, acc_norm) get their closed-form stderr whatever this is; 0 would drop every stderr,
        # and the harness's default (100,000 resamples) costs minutes for a perplexity task on a CPU.
        bootstrap_iters=1000,
    )
    if report is None:  # non-zero ranks under the harness's own data parallelism
        return {}
    keep = ("results", "versions", "n-shot", "n-samples", "higher_is_better")
    return {key: _plain(report[key]) for key in keep if key in report}


def _plain(value: Any) -> Any:
    """JSON-ready: the harness's reports hold numpy scalars and "N/A" strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
