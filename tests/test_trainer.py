"""The training loop: exact resume, accumulation, model return conventions, user data, NaN guard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.engine.checkpoint.files import list_checkpoints, load_checkpoint
from speedtronic.errors import ConfigError, SpeedtronicError


def tiny_config(tmp_path: Path, **sections: Any) -> Any:
    base: dict[str, Any] = {
        "run": {
            "name": "t",
            "max_steps": 8,
            "log_every": 1,
            "eval_every": 4,
            "output_dir": str(tmp_path / "out"),
        },
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "dropout": 0.1},
        "data": {
            "synthetic": True,
            "vocab_size": 64,
            "num_tokens": 20_000,
            "block_size": 16,
            "micro_batch_size": 4,
            "target_batch_size": 8,
            "val_batches": 2,
        },
        "optimizer": {"lr": 3e-3},
        "checkpoint": {"every_steps": 4},
        "logging": {"hooks": []},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return load_config(base)


class Recorder:
    """A training hook that keeps every event payload."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda payload: self.events.append((name[3:], payload))
        raise AttributeError(name)

    def losses(self) -> list[float]:
        return [p["loss"] for e, p in self.events if e == "step"]


def test_resume_is_bitwise_identical(tmp_path: Path) -> None:
    straight = Recorder()
    config_a = tiny_config(tmp_path / "a")
    trainer_a = Trainer(config_a, progress=False, hooks={"rec": straight})
    trainer_a.train()

    first, second = Recorder(), Recorder()
    config_b = tiny_config(tmp_path / "b")
    Trainer(config_b, progress=False, hooks={"rec": first}).train(max_steps=4)
    resumed = Trainer(config_b, progress=False, hooks={"rec": second})
    assert resumed.step == 4 and resumed.resumed_from is not None
    resumed.train()

    assert first.losses() + second.losses() == straight.losses()  # exact float equality, step by step
    for (name, a), b in zip(
        trainer_a.raw_model.state_dict().items(), resumed.raw_model.state_dict().values(), strict=False
    ):
        assert torch.equal(a, b), name
    opt_a, opt_b = trainer_a.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for key in opt_a:
        assert torch.equal(opt_a[key]["exp_avg"], opt_b[key]["exp_avg"])


def test_resume_trains_with_the_configs_optimizer_settings(tmp_path: Path) -> None:
    """`--set optimizer.lr=…` on resume: the plan shows the new rate, so training uses it (the moments
    and the schedule's position still come from the checkpoint)."""
    Trainer(tiny_config(tmp_path), progress=False).train(max_steps=4)
    changed = tiny_config(tmp_path, optimizer={"lr": 1e-3, "weight_decay": 0.05})
    recorder = Recorder()
    resumed = Trainer(changed, progress=False, hooks={"rec": recorder})
    assert resumed.step == 4
    assert any("lr 0.003 → 0.001" in c for c in resumed.resume_changes), resumed.resume_changes
    assert any("weight_decay" in c for c in resumed.resume_changes)
    factor = resumed.scheduler.lr_lambdas[0]
    assert resumed.scheduler.base_lrs == [1e-3] * len(resumed.optimizer.param_groups)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * factor(4))
    assert resumed.optimizer.state  # the moments were restored, not reset
    resumed.train()
    logged = {p["step"]: p["lr"] for e, p in recorder.events if e == "step"}
    assert sorted(logged) == [5, 6, 7, 8]
    for step, lr in logged.items():  # the schedule's rate after that step, from the new base rate
        assert lr == pytest.approx(1e-3 * factor(step)), step
    # Unchanged settings: nothing reapplied (the bitwise resume above depends on it).
    again = Trainer(changed, progress=False)
    assert again.resume_changes == []


def test_accumulation_matches_one_big_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    big = torch.randint(0, 64, (8, 17))
    big_batch = [{"input_ids": big[:, :-1], "labels": big[:, 1:]}]
    micro_batches = [{"input_ids": big[i : i + 2, :-1], "labels": big[i : i + 2, 1:]} for i in range(0, 8, 2)]

    def grads_after_one_step(
        data: list[dict[str, torch.Tensor]], micro: int, target: int
    ) -> list[torch.Tensor]:
        config = tiny_config(
            tmp_path,
            data={"micro_batch_size": micro, "target_batch_size": target},
            model={"dropout": 0.0},
            checkpoint={"enabled": False},
            precision={"mode": "fp32"},  # the numbers compared are fp32's, whatever auto picks here
        )
        trainer = Trainer(config, train_data=data, progress=False)
        captured: list[torch.Tensor] = []
        trainer.optimizer.step = lambda *a, **k: captured.extend(p.grad.clone() for p in trainer.params)
        trainer.train_step()
        return captured

    one = grads_after_one_step(big_batch, 8, 8)
    accumulated = grads_after_one_step(micro_batches, 2, 8)
    assert len(one) == len(accumulated) > 0
    for a, b in zip(one, accumulated, strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class LossOnly(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32)
        self.style = style

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(input_ids))


class ReturnsLoss(LossOnly):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.logits(input_ids)
        loss = F.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1))
        return {"tensor": loss, "mapping": {"loss": loss, "logits": logits}, "tuple": (loss, logits)}[
            self.style
        ]


class ReturnsLogits(LossOnly):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # no labels argument at all
        return self.logits(input_ids)


@pytest.mark.parametrize(
    "model_cls,style",
    [(ReturnsLoss, "tensor"), (ReturnsLoss, "mapping"), (ReturnsLoss, "tuple"), (ReturnsLogits, "logits")],
)
@pytest.mark.parametrize("batch_style", ["mapping", "tuple"])
def test_model_return_conventions(tmp_path: Path, model_cls: type, style: str, batch_style: str) -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 32, (4, 9))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    batch = {"input_ids": inputs, "labels": labels} if batch_style == "mapping" else (inputs, labels)
    model = model_cls(style)
    expected = F.cross_entropy(model.logits(inputs).reshape(-1, 32), labels.reshape(-1)).item()
    config = tiny_config(
        tmp_path,
        data={"micro_batch_size": 4, "target_batch_size": 4},
        checkpoint={"enabled": False},
        run={"max_steps": 3},
    )
    trainer = Trainer(config, model=model, train_data=[batch], val_data=[batch], progress=False)
    loss, _, tokens_seen = trainer.train_step()
    assert loss.item() == pytest.approx(expected, rel=1e-5)  # labels used as given: never shifted twice
    assert tokens_seen == inputs.numel()
    result = trainer.train()
    assert result.final_loss is not None and result.final_loss < expected


def test_user_iterable_resumes_by_fast_forward(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = [(t[:, :-1], t[:, 1:]) for t in torch.randint(0, 64, (6, 4, 17))]
    config = tiny_config(
        tmp_path,
        data={"micro_batch_size": 4, "target_batch_size": 4},
        run={"max_steps": 6},
        checkpoint={"every_steps": 3},
        model={"dropout": 0.0},
    )
    seen: list[torch.Tensor] = []

    class Tracking(list):
        def __iter__(self):  # type: ignore[no-untyped-def]
            for item in super().__iter__():
                seen.append(item[0])
                yield item

    Trainer(config, train_data=Tracking(data), progress=False).train(max_steps=3)
    seen.clear()
    resumed = Trainer(config, train_data=Tracking(data), progress=False)
    assert resumed.step == 3
    resumed.train()
    # the skipped batches are read to fast-forward, then training continues with batch 3
    assert [torch.equal(a, b) for a, b in zip(seen, [d[0] for d in data], strict=False)] == [True] * 6


def test_fresh_start_refuses_to_overwrite_checkpoints(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, run={"max_steps": 4})
    Trainer(config, progress=False).train()
    assert [step for step, _ in list_checkpoints(config.checkpoint_dir())] == [4]
    fresh = tiny_config(tmp_path, run={"max_steps": 4}, checkpoint={"resume": False})
    with pytest.raises(ConfigError, match=r"already holds step_00000004\.pt"):
        Trainer(fresh, progress=False)
    must_resume = tiny_config(tmp_path / "other", checkpoint={"resume": True})
    with pytest.raises(ConfigError, match="no checkpoint"):
        Trainer(must_resume, progress=False)


def test_checkpoint_contents(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        run={"max_steps": 4},
        distributed={
            "bus": {"token": "hf_abcdefghijklmnopqrstuv"},
        },
    )
    trainer = Trainer(config, progress=False)
    result = trainer.train()
    payload = load_checkpoint(result.checkpoint)
    # One layout (engine/checkpoint/layout.py): the user's config, the plan, and each part's state_dict().
    assert set(payload) == {"format", "step", "created_at", "config", "plan", "parts", "metrics"}
    parts = payload["parts"]
    assert list(parts) == ["model", "optimizer", "scheduler", "data", "rng", "counters"]
    assert payload["step"] == 4 and parts["counters"]["tokens_seen"] == 4 * 8 * 16 == result.tokens
    assert payload["plan"] == trainer.plan.as_dict() and payload["plan"]["stop_step"] == 4
    assert (
        payload["config"]["scheduler"]["warmup_steps"] is None
    )  # as written: the plan holds what is derived
    assert parts["data"] and parts["rng"]["torch"].dtype == torch.uint8
    assert payload["metrics"]["val_loss"] == pytest.approx(result.val_loss)
    assert "hf_abcdefghijklmnopqrstuv" not in repr(payload["config"])
    assert payload["config"]["distributed"]["bus"]["token"] == "**********"


def test_nan_loss_stops_with_clear_error(tmp_path: Path) -> None:
    class Exploding(ReturnsLogits):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.logits(input_ids) * float("nan")

    tokens = torch.randint(0, 32, (4, 9))
    config = tiny_config(tmp_path, data={"micro_batch_size": 4, "target_batch_size": 4})
    trainer = Trainer(
        config, model=Exploding("logits"), train_data=[(tokens[:, :-1], tokens[:, 1:])], progress=False
    )
    with pytest.raises(SpeedtronicError, match="loss is nan at step 1"):
        trainer.train()
    assert list_checkpoints(config.checkpoint_dir()) == []  # nothing poisoned was saved


def test_eval_reports_loss_and_perplexity(tmp_path: Path) -> None:
    recorder = Recorder()
    result = Trainer(tiny_config(tmp_path), progress=False, hooks={"rec": recorder}).train()
    evals = [p for e, p in recorder.events if e == "eval"]
    assert [p["step"] for p in evals] == [4, 8]
    assert evals[-1]["val_ppl"] == pytest.approx(
        torch.exp(torch.tensor(evals[-1]["val_loss"])).item(), rel=1e-5
    )
    assert result.val_loss == evals[-1]["val_loss"]
    steps = [p for e, p in recorder.events if e == "step"]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(steps[0])
    assert next(e for e, _ in recorder.events) == "train_start" and recorder.events[-1][0] == "train_end"
