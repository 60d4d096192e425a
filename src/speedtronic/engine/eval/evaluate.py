"""Is the model any good? Loss, perplexity and bits per byte over documents, and task accuracy.

Everything reduces to one batched primitive, `score`: for token sequences and the index from which
each is scored, the summed log-probability of the scored tokens given everything before them, and
whether greedy decoding would have produced exactly those tokens. Sequences are sorted by length,
right-padded (a causal model's real positions never see the padding after them) and run through
the model by the training contract (engine/batches.py), so any registered model, on any device.

* Documents (`score_documents`): each is scored whole in windows of the model's context, every token
  after the first once (the tokenizer's EOS, when it has one, goes first as context, so the first
  token is scored too). loss = NLL / tokens (nats), perplexity = e^loss, bits per byte =
  NLL / (ln 2 × UTF-8 bytes of the text scored) — tokenizer-independent.
* Multiple choice (`score_tasks`): the log-likelihood of each choice after the context; `acc` takes
  the largest sum, `acc_norm` the largest sum per character of the choice (the LM Evaluation
  Harness's definitions). A choice's tokens are those of context+choice after the context's own
  (the harness's split), so a BPE merge across the boundary is scored as the model would see it.
* Completion: exact match when greedy decoding continues the context with the answer's tokens —
  the argmax at every answer position is the answer's token (one forward pass, no sampling loop).
Contexts longer than the model's window keep their end. Statistics are in speedtronic/eval_tasks.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speedtronic.engine.batches import call_model, logits_from_output
from speedtronic.eval_tasks import Task, centred, core_score, mean_stderr

# (phase, done, total): how a caller shows progress (a bar on a terminal).
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Scored:
    logprob: float  # summed log-probability (nats) of the scored tokens
    tokens: int  # how many were scored
    greedy: bool  # greedy decoding would produce exactly them


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


@torch.no_grad()
def score(
    model: nn.Module,
    sequences: list[list[int]],
    starts: list[int],
    *,
    batch_size: int = 16,
    progress: Progress | None = None,
    phase: str = "score",
) -> list[Scored]:
    """Score tokens sequence[start:] of each sequence given sequence[:start] (start >= 1); every
    sequence must fit the model (at most its context + 1 tokens)."""
    device = _device_of(model)
    was_training = model.training
    model.eval()
    out: list[Scored | None] = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    try:
        for first in range(0, len(order), batch_size):
            chunk = order[first : first + batch_size]
            width = len(sequences[chunk[0]]) - 1
            inputs = torch.zeros(len(chunk), width, dtype=torch.long)
            targets = torch.full((len(chunk), width), -1, dtype=torch.long)
            for row, index in enumerate(chunk):
                seq, start = sequences[index], starts[index]
                if not 1 <= start < len(seq):
                    raise ValueError(f"score: start {start} outside 1..{len(seq) - 1}")
                inputs[row, : len(seq) - 1] = torch.tensor(seq[:-1])
                # Only the scored positions get a target; the rest (and padding) stay -1.
                targets[row, start - 1 : len(seq) - 1] = torch.tensor(seq[start:])
            inputs, targets = inputs.to(device), targets.to(device)
            output, _ = call_model(model, {"input_ids": inputs}, pass_labels=False)
            logits = logits_from_output(output).float()
            mask = targets >= 0
            picked = targets.clamp(min=0)
            logprobs = torch.gather(F.log_softmax(logits, dim=-1), 2, picked[..., None])[..., 0]
            hits = logits.argmax(dim=-1) == picked
            sums = (logprobs * mask).double().sum(dim=1).tolist()
            counts = mask.sum(dim=1).tolist()
            greedy = (hits | ~mask).all(dim=1).tolist()
            for row, index in enumerate(chunk):
                out[index] = Scored(sums[row], int(counts[row]), bool(greedy[row]))
            if progress is not None:
                progress(phase, min(first + batch_size, len(order)), len(order))
    finally:
        model.train(was_training)
    return [s for s in out if s is not None]


def _fit(context: list[int], continuation: list[int], max_seq_len: int) -> tuple[list[int], int]:
    """context + continuation cut to the model's window from the left; (tokens, first scored)."""
    seq = context + continuation
    keep = max_seq_len + 1
    if len(seq) > keep:
        seq = seq[-keep:]
    return seq, max(1, len(seq) - len(continuation))


def _split_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    ctx = list(tokenizer.encode(context))
    whole = list(tokenizer.encode(context + continuation))
    if len(whole) > len(ctx) and whole[: len(ctx)] == ctx:
        return ctx, whole[len(ctx) :]
    return ctx, list(tokenizer.encode(continuation))


def score_tasks(
    model: nn.Module,
    tokenizer: Any,
    tasks: list[Task],
    *,
    max_seq_len: int,
    batch_size: int = 16,
    progress: Progress | None = None,
) -> dict[str, dict[str, Any]]:
    """Each task's accuracy (see the module doc), keyed by task name; `aggregate` is not added here."""
    results: dict[str, dict[str, Any]] = {}
    for task in tasks:
        sequences: list[list[int]] = []
        starts: list[int] = []
        owners: list[int] = []
        for number, example in enumerate(task.examples):
            options = example.choices if task.kind == "multiple_choice" else (example.answer,)
            for option in options:
                ctx, cont = _split_pair(tokenizer, example.context, option)
                if not ctx:  # nothing to predict the first token from: the EOS is the context
                    eos = getattr(tokenizer, "eos_id", None)
                    ctx = [eos] if eos is not None else cont[:1]
                    cont = cont if eos is not None else cont[1:]
                if not cont:
                    cont = ctx[-1:]
                    ctx = ctx[:-1] or [0]
                seq, start = _fit(ctx, cont, max_seq_len)
                sequences.append(seq)
                starts.append(start)
                owners.append(number)
        scored = score(model, sequences, starts, batch_size=batch_size, progress=progress, phase=task.name)
        results[task.name] = _task_result(task, scored)
    return results


def _task_result(task: Task, scored: list[Scored]) -> dict[str, Any]:
    result: dict[str, Any] = {"kind": task.kind, "n": len(task.examples), "chance": task.chance}
    if task.kind == "completion":
        hits = [s.greedy for s in scored]
        result.update(exact_match=sum(hits) / len(hits), exact_match_stderr=mean_stderr(hits))
        result["answer_nll"] = -sum(s.logprob for s in scored) / max(1, sum(s.tokens for s in scored))
    else:
        acc: list[bool] = []
        norm: list[bool] = []
        offset = 0
        for example in task.examples:
            mine = scored[offset : offset + len(example.choices)]
            offset += len(example.choices)
            sums = [s.logprob for s in mine]
            per_char = [s.logprob / len(choice) for s, choice in zip(mine, example.choices, strict=True)]
            acc.append(_argmax(sums) == example.label)
            norm.append(_argmax(per_char) == example.label)
        result.update(acc=sum(acc) / len(acc), acc_stderr=mean_stderr(acc))
        result.update(acc_norm=sum(norm) / len(norm), acc_norm_stderr=mean_stderr(norm))
    result["metric"] = task.metric
    result["accuracy"] = result[task.metric]
    result["stderr"] = result[f"{task.metric}_stderr"]
    result["centred"] = centred(result["accuracy"], result["chance"])
    return result


def _argmax(values: list[float]) -> int:
    """The first index of the largest value (a tie counts against the model only if the label is later)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def score_documents(
    model: nn.Module,
    tokenizer: Any,
    docs: Iterable[Any],
    *,
    max_seq_len: int,
    max_tokens: int | None = None,
    batch_size: int = 16,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Loss, perplexity and bits per byte over `docs` (eval_data.Document), at most `max_tokens`
    scored tokens (the last document taken is cut there)."""
    eos = getattr(tokenizer, "eos_id", None)
    sequences: list[list[int]] = []
    total_tokens = total_bytes = documents = 0
    for doc in docs:
        tokens = ([eos] if eos is not None else []) + list(doc.tokens)
        scorable = len(tokens) - 1
        if scorable <= 0:
            continue
        nbytes = doc.nbytes
        if eos is None:  # the first token is context only: its bytes are not scored either
            nbytes -= _nbytes(tokenizer, tokens[:1])
        if max_tokens is not None and total_tokens + scorable > max_tokens:
            scorable = max_tokens - total_tokens
            if scorable <= 0:
                break
            tokens = tokens[: scorable + 1]
            if eos is not None:  # the EOS put first has no bytes in the text
                nbytes = _nbytes(tokenizer, tokens[1:])
            else:
                nbytes = _nbytes(tokenizer, tokens) - _nbytes(tokenizer, tokens[:1])
        # Windows overlap by one token: the last target of one is the first input of the next.
        for start in range(0, len(tokens) - 1, max_seq_len):
            sequences.append(tokens[start : start + max_seq_len + 1])
        total_tokens += scorable
        total_bytes += max(nbytes, 0)
        documents += 1
        if max_tokens is not None and total_tokens >= max_tokens:
            break
    if not sequences:
        return {
            "loss": None,
            "perplexity": None,
            "bits_per_byte": None,
            "tokens": 0,
            "bytes": 0,
            "documents": 0,
        }
    scored = score(
        model, sequences, [1] * len(sequences), batch_size=batch_size, progress=progress, phase="data"
    )
    nll = -sum(s.logprob for s in scored)
    tokens_scored = sum(s.tokens for s in scored)
    loss = nll / tokens_scored
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nll / (math.log(2) * total_bytes) if total_bytes else None,
        "tokens": tokens_scored,
        "bytes": total_bytes,
        "documents": documents,
    }


def _nbytes(tokenizer: Any, tokens: list[int]) -> int:
    from speedtronic.engine.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return len(tokens)
    return len(tokenizer.decode(tokens).encode("utf-8"))


def pooled(by_source: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Loss, perplexity and bits per byte over every source's scored tokens together."""
    scored = [r for r in by_source.values() if r["loss"] is not None]
    tokens = sum(r["tokens"] for r in scored)
    if not tokens:
        return {"loss": None, "perplexity": None, "bits_per_byte": None, "n": 0}
    nll = sum(r["loss"] * r["tokens"] for r in scored)
    nbytes = sum(r["bytes"] for r in scored)
    loss = nll / tokens
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": nll / (math.log(2) * nbytes) if nbytes else None,
        "n": tokens,
    }


def aggregate(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`accuracy` per task plus `aggregate` (the CORE-style mean of centred accuracies)."""
    accuracy: dict[str, Any] = {name: r["accuracy"] for name, r in results.items()}
    accuracy["aggregate"] = core_score(results)
    return accuracy


def evaluate_checkpoint(
    path: Any,
    *,
    data: str | None = None,
    tasks: list[Task] = (),  # type: ignore[assignment]
    max_tokens: int | None = None,
    batch_size: int = 16,
    device: str = "cpu",
    text_field: str = "text",
    registries: Any = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """What `speedtronic eval` reports for the checkpoint at `path` (a file or a checkpoint folder,
    sharded ones too): the model is rebuilt by engine/checkpoint/load_run.py's `load_run`."""
    from speedtronic.engine.checkpoint.load_run import load_run

    run = load_run(path, device=device, registries=registries)
    assert run.model is not None
    return evaluate_model(
        run.model,
        run.tokenizer,
        max_seq_len=run.plan.max_seq_len,
        data=data,
        tasks=tasks,
        max_tokens=max_tokens,
        batch_size=batch_size,
        text_field=text_field,
        progress=progress,
    ) | {"checkpoint": str(run.path), "step": run.checkpoint.step}


def evaluate_model(
    model: nn.Module,
    tokenizer: Any,
    *,
    max_seq_len: int,
    data: str | None = None,
    tasks: list[Task] = (),  # type: ignore[assignment]
    max_tokens: int | None = None,
    batch_size: int = 16,
    text_field: str = "text",
    progress: Progress | None = None,
    sources: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The report of one model: data metrics (null without `data`) and per-task results. `sources`
    ({name: path}, a data mixture's sources) are scored each, under `data_sources`, and pooled."""
    report: dict[str, Any] = {"loss": None, "perplexity": None, "bits_per_byte": None, "n": 0}
    if sources:
        from speedtronic.engine.eval.data import documents

        by_source = {
            name: {
                "path": path,
                **score_documents(
                    model,
                    tokenizer,
                    documents(path, tokenizer, text_field),
                    max_seq_len=max_seq_len,
                    max_tokens=max_tokens,
                    batch_size=batch_size,
                    progress=progress,
                ),
            }
            for name, path in sources.items()
        }
        report.update(pooled(by_source), data_sources=by_source)
    if data is not None:
        from speedtronic.engine.eval.data import documents

        scored = score_documents(
            model,
            tokenizer,
            documents(data, tokenizer, text_field),
            max_seq_len=max_seq_len,
            max_tokens=max_tokens,
            batch_size=batch_size,
            progress=progress,
        )
        report.update(
            loss=scored["loss"],
            perplexity=scored["perplexity"],
            bits_per_byte=scored["bits_per_byte"],
            n=scored["tokens"],
            data={"path": data, **scored},
        )
    results = score_tasks(
        model, tokenizer, list(tasks), max_seq_len=max_seq_len, batch_size=batch_size, progress=progress
    )
    report["tasks"] = results
    report["accuracy"] = aggregate(results) if results else {}
    return report
