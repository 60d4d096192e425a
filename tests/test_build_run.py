"""`build_run`: one construction path. A `Run` holds every part of a run, built; `Trainer(run)` trains
it exactly as `Trainer(config)` does; a resumed run comes back restored; `model.init_from` is applied
while the model is built — for the trainer and the DiLoCo master's reference model alike — and
building a run reaches neither into `speedtronic.interop` nor `speedtronic.diloco`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from speedtronic import Run, RunPlan, Trainer, build_run
from speedtronic.config import load_config
from speedtronic.errors import ConfigError


def tiny_raw(tmp_path: Path, **model: Any) -> dict[str, Any]:
    return {
        "run": {"max_steps": 6, "log_every": 1, "eval_every": 3, "output_dir": str(tmp_path / "out")},
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "dropout": 0.1, **model},
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
        "checkpoint": {"every_steps": 3},
        "logging": {"hooks": []},
    }


def tiny(tmp_path: Path, **model: Any) -> Any:
    return load_config(tiny_raw(tmp_path, **model))


class Losses:
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_step(self, payload: dict[str, Any]) -> None:
        self.values.append(payload["loss"])


def test_a_built_run_holds_every_part_and_trains_as_trainer_config_does(tmp_path: Path) -> None:
    built, straight = Losses(), Losses()
    run = build_run(tiny(tmp_path / "a"), hooks={"losses": built}, progress=False)
    assert isinstance(run, Run) and isinstance(run.plan, RunPlan)
    assert set(run.parts) == {"model", "optimizer", "scheduler", "data", "rng", "counters"}
    assert run.parts["model"] is run.raw_model and run.parts["optimizer"] is run.optimizer
    assert run.model is run.raw_model and run.ddp is None and not run.fsdp  # one process: no wrap
    assert run.parts["data"] is run.data and run.data_bundle is not None and run.val_source is None
    assert run.resume is None and run.counters.step == 0 and run.plan.stop_step == 6
    assert run.events.hooks == {"losses": built}
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.plan = run.plan  # type: ignore[misc]

    trainer = Trainer(run)
    assert trainer.raw_model is run.raw_model and trainer.plan is run.plan
    result = trainer.train()
    reference = Trainer(tiny(tmp_path / "b"), hooks={"losses": straight}, progress=False)
    expected = reference.train()
    assert built.values == straight.values and len(built.values) == 6
    assert (result.final_loss, result.val_loss) == (expected.final_loss, expected.val_loss)
    for (name, a), b in zip(
        run.raw_model.state_dict().items(), reference.raw_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_build_run_resumes_restored_and_a_built_run_takes_no_parts(tmp_path: Path) -> None:
    config = tiny(tmp_path)
    first = Trainer(config, progress=False)
    first.train(max_steps=3)
    run = build_run(config, progress=False)  # checkpoint.resume auto: the step-3 checkpoint
    assert run.resume is not None and run.resume.step == 3
    assert run.counters.step == 3 and run.plan.start_step == 3
    for (name, a), b in zip(
        run.raw_model.state_dict().items(), first.raw_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert build_run(config, resume=None, progress=False).counters.step == 0  # asked for a fresh start
    with pytest.raises(ConfigError, match="hooks given beside a built run; pass them to build_run"):
        Trainer(run, hooks={})
    assert Trainer(run).train().steps == 6


def llama_folder(folder: Path, config: Any) -> dict[str, torch.Tensor]:
    """A Llama folder (config.json + model.safetensors, Llama names) holding random weights for the
    model `config` describes; returns those weights under our names."""
    from safetensors.torch import save_file

    from speedtronic.engine import llama
    from speedtronic.engine.build import build_model

    torch.manual_seed(11)
    model = build_model(config, 64)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    folder.mkdir(parents=True)
    hf = llama.hf_config(model.config, dtype="float32", bos_id=None, eos_id=None)
    (folder / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    save_file(
        {llama.to_hf_name(name): t.contiguous() for name, t in state.items()}, folder / "model.safetensors"
    )
    return state


def test_init_from_is_applied_while_building_without_interop_or_diloco(tmp_path: Path, run_cli: Any) -> None:
    fields = {"n_head": 4, "d_model": 64, "dropout": 0.0, "tie_weights": False}
    source = tmp_path / "llama"
    expected = llama_folder(source, tiny(tmp_path, **fields))
    raw = tiny_raw(tmp_path, init_from=str(source), **fields)
    code = f"""
import json, sys
import torch
from safetensors.torch import load_file
from speedtronic import build_run, load_config
from speedtronic.engine import llama
run = build_run(load_config(json.loads({json.dumps(json.dumps(raw))})), progress=False)
source = {{llama.from_hf_name(k): v for k, v in load_file({str(source / "model.safetensors")!r}).items()}}
same = all(torch.equal(v, source[k]) for k, v in run.raw_model.state_dict().items())
up = sorted(m for m in sys.modules if m.startswith(("speedtronic.interop", "speedtronic.diloco")))
print(json.dumps({{"same": same, "up": up}}))
"""
    done = run_cli(python_code=code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"same": True, "up": []}

    # The DiLoCo master's reference model (the run's global model at outer step 0) goes through the
    # same model building: it starts from the pretrained weights too.
    from speedtronic.diloco.launch import build_reference

    model, bundle, _ = build_reference(load_config(raw))
    assert bundle.vocab_size == 64
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
