"""Out-of-order backward on CUDA streams, tested without CUDA: the fork trace and stream plan, the
sync order each side branch gets, bitwise-equal losses and gradients through the scheduler's hooks
(with a recording stream shim), and the logged no-op on CPU inside the trainer."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic.config import load_config
from speedtronic.engine.model import Transformer, TransformerConfig
from speedtronic.engine.streams import RecordingStreamOps, StreamScheduler, maybe_enable, plan_streams


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, d_model=32))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 16), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def test_trace_finds_the_independent_branches_of_each_block() -> None:
    model = tiny_model()
    scheduler = StreamScheduler(model, 2, RecordingStreamOps()).attach()
    model(*batch())  # the first forward traces
    assert scheduler.plan is not None
    expected = []
    for i in range(2):
        expected.append([f"blocks.{i}.attn.q_proj", f"blocks.{i}.attn.k_proj", f"blocks.{i}.attn.v_proj"])
        expected.append([f"blocks.{i}.mlp.gate_proj", f"blocks.{i}.mlp.up_proj"])
    assert scheduler.plan.forks == expected  # norms, lm head and embedding read tensors nobody shares
    assert scheduler.plan.stream_of["blocks.0.attn.q_proj"] == 0  # the first branch stays put
    assert scheduler.plan.stream_of["blocks.0.attn.k_proj"] == 1
    assert scheduler.plan.stream_of["blocks.0.attn.v_proj"] == 0  # j mod 2
    assert scheduler.plan.side_branches == 4
    assert "4 forks" in scheduler.plan.describe()


def test_plan_assigns_round_robin_and_refuses_overlapping_forks() -> None:
    plan = plan_streams([["a", "b", "c"], ["d", "e"]], 3)
    assert plan.stream_of == {"a": 0, "b": 1, "c": 2, "d": 0, "e": 1}
    assert plan_streams([["a", "b"]], 1).side_branches == 0
    with pytest.raises(ValueError, match="disjoint"):
        plan_streams([["a", "b"], ["b", "c"]], 2)


def test_side_branch_sync_order() -> None:
    model, ops = tiny_model(), RecordingStreamOps()
    StreamScheduler(model, 2, ops).attach()
    model(*batch())
    assert ops.log == []  # the tracing forward runs sequentially
    model(*batch())
    k = [entry for entry in ops.log if "k_proj" in "".join(entry)]
    start = ops.log.index(("wait", "s1", "s0"))
    assert ops.log[start : start + 6] == [
        ("wait", "s1", "s0"),  # side waits for the caller that produced the input
        ("record", "blocks.0.attn.k_proj:in", "s1"),  # input used on the side stream
        ("use", "s1"),
        ("use", "s0"),
        ("wait", "s0", "s1"),  # the consumer waits on the producer
        ("record", "blocks.0.attn.k_proj:out", "s0"),  # output allocated on s1, used on s0
    ]
    assert len(k) == 2 * 2  # k_proj of both blocks: record in + record out each
    assert len(ops.log) == 4 * 6  # 4 side branches (k_proj, up_proj of 2 blocks), 6 operations each
    assert ops.current() == "s0"


def test_results_equal_the_sequential_path_bitwise() -> None:
    plain = tiny_model()
    scheduled = copy.deepcopy(plain)
    StreamScheduler(scheduled, 3, RecordingStreamOps()).attach()
    opt_a = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(scheduled.parameters(), lr=1e-2)
    for _ in range(3):  # trace step, then scheduled steps
        for model, opt in ((plain, opt_a), (scheduled, opt_b)):
            opt.zero_grad()
            model(*batch())["loss"].backward()
        for (name, a), b in zip(plain.named_parameters(), scheduled.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), name
        opt_a.step()
        opt_b.step()
    for a, b in zip(plain.parameters(), scheduled.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_model_without_forks_stays_on_one_stream() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    ops = RecordingStreamOps()
    scheduler = StreamScheduler(model, 2, ops).attach()
    model(torch.randn(2, 4))
    model(torch.randn(2, 4))
    assert scheduler.plan is not None and scheduler.plan.forks == [] and ops.log == []
    assert "no independent branches" in scheduler.plan.describe()


def cfg(tmp_path: Path, **root: Any) -> Any:
    return load_config(
        {
            "run": {"max_steps": 3, "log_every": 1, "eval_every": 0, "output_dir": str(tmp_path / "out")},
            "model": {"n_layer": 2, "n_head": 2, "d_model": 32},
            "data": {
                "synthetic": True,
                "vocab_size": 64,
                "num_tokens": 5000,
                "block_size": 16,
                "micro_batch_size": 4,
            },
            "checkpoint": {"enabled": False},
            "logging": {"hooks": []},
            **root,
        }
    )


def test_noop_with_a_log_line_on_cpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model()
    with caplog.at_level(logging.INFO, logger="speedtronic"):
        assert maybe_enable(model, cfg(tmp_path, ooo_backprop=True), torch.device("cpu")) is None
        assert maybe_enable(model, cfg(tmp_path, ooo_backprop=True), torch.device("mps")) is None
    assert "ooo_backprop is a no-op: CUDA streams only; running sequentially on cpu" in caplog.text
    assert "on mps" in caplog.text
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert maybe_enable(model, cfg(tmp_path), torch.device("cuda")) is None  # off by default


def test_trainer_with_ooo_on_cpu_matches_sequential(tmp_path: Path) -> None:
    from speedtronic import Trainer

    results = []
    for flag in (False, True):
        trainer = Trainer(cfg(tmp_path / str(flag), ooo_backprop=flag), progress=False)
        result = trainer.train()
        results.append((result.final_loss, [p.detach().clone() for p in trainer.raw_model.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
