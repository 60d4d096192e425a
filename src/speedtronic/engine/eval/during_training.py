"""`run.eval_tasks`: the task files `speedtronic eval --task` takes, scored at each evaluation of a run.

The trainer calls `TaskEval.score` beside its validation loss (every `run.eval_every` steps and at
the end); what it returns rides in the `eval` event, so metrics.jsonl, `speedtronic runs` and the
TensorBoard/W&B hooks see it: `core` (the CORE-style aggregate, speedtronic/eval_tasks.py) and
`tasks` ({name: {accuracy, stderr, metric, chance, centred, n}}). Every rank scores every task: the
forwards are collective under fsdp, and the few hundred examples of a task cost little.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from speedtronic.errors import ConfigError
from speedtronic.eval_tasks import Task, load_tasks

_KEPT = ("accuracy", "stderr", "metric", "chance", "centred", "n")


class TaskEval:
    def __init__(self, tasks: list[Task], tokenizer: Any, max_seq_len: int, batch_size: int) -> None:
        self.tasks, self.tokenizer = tasks, tokenizer
        self.max_seq_len, self.batch_size = max_seq_len, batch_size

    @classmethod
    def for_run(cls, config: Any, plan: Any) -> TaskEval | None:
        """The run's task evaluation, or None without `run.eval_tasks`; task files and the
        tokenizer are checked here, before the first step."""
        if not config.run.eval_tasks:
            return None
        tasks = load_tasks(list(config.run.eval_tasks), "run.eval_tasks")
        from speedtronic.engine.data import load_tokenizer

        tokenizer = load_tokenizer(plan.tokenizer)
        if tokenizer.vocab_size > plan.vocab_size:
            raise ConfigError(
                f"run.eval_tasks: the model's vocabulary ({plan.vocab_size:,}) is smaller than its "
                f"tokenizer's ({tokenizer.vocab_size:,}; synthetic data?), so task text cannot be fed to it; "
                "train on text, or leave run.eval_tasks empty"
            )
        return cls(tasks, tokenizer, plan.max_seq_len, config.data.micro_batch_size)

    def score(self, model: nn.Module) -> dict[str, Any]:
        """{"core": aggregate, "tasks": {name: {...}}} for `model` (left in the mode it was in)."""
        from speedtronic.engine.eval.evaluate import score_tasks
        from speedtronic.eval_tasks import core_score

        results = score_tasks(
            model, self.tokenizer, self.tasks, max_seq_len=self.max_seq_len, batch_size=self.batch_size
        )
        return {
            "core": core_score(results),
            "tasks": {name: {key: r[key] for key in _KEPT} for name, r in results.items()},
        }
