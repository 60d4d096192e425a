"""The hybrid Muon/AdamW optimizer: routing, one state_dict, schedulers, closures, registry, resume."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from speedtronic import Trainer
from speedtronic.config import load_config
from speedtronic.engine.build import build_model, build_optimizer
from speedtronic.engine.model import Transformer, TransformerConfig
from speedtronic.engine.schedule import lr_multiplier
from speedtronic.hookspecs import Register, hookimpl
from speedtronic.optim.cautious import Cautious, CautiousAdamW
from speedtronic.optim.hybrid import HybridOptimizer
from speedtronic.optim.muon import Muon
from speedtronic.optim.routing import route_parameters
from speedtronic.plugins import get_plugin_host, reset_plugin_host


def tiny_transformer(tie: bool) -> Transformer:
    return Transformer(
        TransformerConfig(
            vocab_size=64, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32, tie_weights=tie
        )
    )


def optimizer_config(**fields: Any) -> Any:
    return load_config({"optimizer": fields}).optimizer


def hybrid(model: nn.Module, **fields: Any) -> Any:
    from speedtronic.builtin.optimizers import build_muon

    return build_muon(model, optimizer_config(name="muon", **fields))


# ------------------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("tie", [True, False])
def test_reference_model_routing(tie: bool) -> None:
    model = tiny_transformer(tie)
    names = route_parameters(model).names()
    muon, adamw = set(names["muon"]), set(names["adamw"])
    assert not muon & adamw
    # Each trainable parameter exactly once, the tied head included only once.
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    for name in muon:
        assert name.split(".")[-2] in {
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        }
    hidden = [n for n, p in model.named_parameters() if p.ndim == 2 and "proj" in n]
    assert muon == set(hidden)
    assert any("emb" in n for n in adamw)
    assert all(model.get_parameter(n).ndim == 1 for n in adamw if "norm" in n)
    head = model.lm_head.weight
    assert any(model.get_parameter(n) is head for n in adamw)  # 2-D, yet AdamW: it is the head


class CustomNet(nn.Module):
    """No roles, no get_output_embeddings: routing must find the head by its vocabulary size."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 16, 3)
        self.hidden = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.special = nn.Linear(24, 24, bias=False)
        self.special._speedtronic_optimizer_role = "adamw"
        self.scale = nn.Parameter(torch.ones(24, 24))
        self.scale._speedtronic_optimizer_role = "muon"  # type: ignore[attr-defined]
        self.out = nn.Linear(24, 50)


def test_custom_model_routing() -> None:
    routes = route_parameters(CustomNet())
    names = routes.names()
    assert sorted(names["muon"]) == ["hidden.weight", "scale"]
    assert sorted(names["adamw"]) == sorted(
        [
            "embed.weight",
            "conv.weight",
            "conv.bias",
            "hidden.bias",
            "norm.weight",
            "norm.bias",
            "special.weight",
            "out.weight",
            "out.bias",
        ]
    )
    assert routes.reasons["out.weight"] == "output head" and routes.reasons["special.weight"] == "module role"
    assert routes.counts() == {"muon": 16 * 24 + 24 * 24, "adamw": sum(p.numel() for _, p in routes.adamw)}


def test_module_opt_in_and_bad_roles() -> None:
    net = nn.Sequential(nn.Conv1d(4, 4, 1), nn.Linear(4, 4))
    net[1]._speedtronic_optimizer_role = "muon"
    assert route_parameters(net).names()["muon"] == ["1.weight"]  # the bias stays with AdamW
    net[1]._speedtronic_optimizer_role = "sgd"
    with pytest.raises(ValueError, match="'muon' or 'adamw'"):
        route_parameters(net)
    vector = nn.Linear(4, 4)
    vector.bias._speedtronic_optimizer_role = "muon"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="only optimises 2-D"):
        route_parameters(vector)


def test_get_output_embeddings_wins_over_the_vocabulary_guess() -> None:
    class WithGetter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 30)

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    assert route_parameters(WithGetter()).names()["muon"] == ["body.weight"]


# -------------------------------------------------------------------------------------------- hybrid


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    tokens = torch.randint(0, 64, (2, 9))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_hybrid_state_dict_round_trip_is_bitwise() -> None:
    torch.manual_seed(0)
    a = tiny_transformer(True)
    b = tiny_transformer(True)
    b.load_state_dict(a.state_dict())
    opt_a = hybrid(a, lr=1e-2)
    for seed in range(3):
        one_step(a, opt_a, seed)
    buffer = io.BytesIO()  # through bytes, as a checkpoint does: an in-memory state_dict shares tensors
    torch.save(opt_a.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    b.load_state_dict(a.state_dict())
    opt_b = hybrid(b, lr=1e-2)
    opt_b.load_state_dict(saved)
    for seed in range(3, 6):
        one_step(a, opt_a, seed)
        one_step(b, opt_b, seed)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    # The inner optimizers still share the object's state after loading.
    assert (
        opt_b.inner["muon"].state is opt_b.state
        and opt_b.inner["adamw"].param_groups[0] is opt_b.param_groups[1]
    )


def test_loading_state_from_a_differently_routed_model_is_refused() -> None:
    opt = hybrid(tiny_transformer(True))
    only_adamw = HybridOptimizer(nn.LayerNorm(4), lambda g: Muon(g), lambda g: torch.optim.AdamW(g))
    with pytest.raises(ValueError, match="do not match"):
        opt.load_state_dict(only_adamw.state_dict())


def test_both_routes_follow_the_schedule_from_their_own_lr() -> None:
    config = load_config(
        {
            "optimizer": {"name": "muon", "lr": 1e-3, "muon_lr": 4e-3},
            "scheduler": {"name": "linear", "warmup_steps": 2},
            "run": {"max_steps": 10},
        }
    )
    optimizer = hybrid(tiny_transformer(False), lr=1e-3, muon_lr=4e-3)
    factor = lr_multiplier(config.scheduler.name, config.scheduler.warmup_steps or 0, 10, 0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    lrs = {g["route"]: g["lr"] for g in optimizer.param_groups}
    assert lrs["muon"] == pytest.approx(4 * lrs["adamw"]) and lrs["adamw"] < 1e-3
    assert optimizer.inner["muon"].param_groups[0]["lr"] == lrs["muon"]


def test_closure_runs_exactly_once() -> None:
    model = tiny_transformer(True)
    optimizer = hybrid(model)
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        optimizer.zero_grad()
        tokens = torch.randint(0, 64, (2, 9))
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])["loss"]
        loss.backward()
        return loss

    assert isinstance(optimizer.step(closure), torch.Tensor) and len(calls) == 1


def test_no_empty_inner_optimizer_is_built() -> None:
    assert list(hybrid(nn.LayerNorm(8)).inner) == ["adamw"]
    assert list(hybrid(nn.Sequential(nn.Linear(8, 8, bias=False))).inner) == ["muon"]
    frozen = nn.Linear(4, 4)
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        hybrid(frozen)


def test_cautious_flag_reaches_both_routes() -> None:
    optimizer = hybrid(tiny_transformer(True), cautious=True)
    assert isinstance(optimizer.inner["adamw"], CautiousAdamW)
    assert optimizer.inner["muon"].param_groups[0]["cautious"] is True


# ------------------------------------------------------------------------------------------ registry


class SGDPlugin:
    @hookimpl
    def register_optimizers(self, register: Register) -> None:
        register("plugin-sgd", lambda model, config: torch.optim.SGD(model.parameters(), lr=config.lr))


def test_names_select_optimizers_and_cautious_composes_with_a_plugin_optimizer() -> None:
    reset_plugin_host()
    host = get_plugin_host()
    host.register(SGDPlugin(), name="sgd-plugin")
    try:
        model = tiny_transformer(True)

        def build(**fields: Any) -> torch.optim.Optimizer:
            return build_optimizer(load_config({"optimizer": fields}), model, host.registries())

        assert isinstance(build(name="adamw"), torch.optim.AdamW)
        assert isinstance(build(name="adamw", cautious=True), CautiousAdamW)
        assert isinstance(build(name="muon"), HybridOptimizer)
        plus = build(name="muon_plus")
        assert plus.inner["muon"].param_groups[0]["muon_plus"] == "col"
        assert build(name="muon", muon_plus="row_col").inner["muon"].param_groups[0]["muon_plus"] == "row_col"
        assert isinstance(build(name="plugin-sgd"), torch.optim.SGD)
        wrapped = build(name="plugin-sgd", cautious=True)
        assert isinstance(wrapped, Cautious) and isinstance(wrapped.inner, torch.optim.SGD)
    finally:
        host.unregister("sgd-plugin")
        reset_plugin_host()


# ---------------------------------------------------------------------------------------- training


def tiny_run(tmp_path: Path, **optimizer: Any) -> Any:
    return load_config(
        {
            "run": {
                "name": "o",
                "max_steps": 6,
                "log_every": 1,
                "eval_every": 0,
                "output_dir": str(tmp_path),
            },
            "model": {"n_layer": 2, "n_head": 2, "d_model": 32},
            "data": {
                "synthetic": True,
                "vocab_size": 64,
                "num_tokens": 20_000,
                "block_size": 16,
                "micro_batch_size": 4,
            },
            "optimizer": {"lr": 3e-3, **optimizer},
            "checkpoint": {"every_steps": 3},
            "logging": {"hooks": []},
        }
    )


class Losses:
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_step(self, payload: dict[str, Any]) -> None:
        self.values.append(payload["loss"])


@pytest.mark.parametrize(
    "optimizer",
    [
        {"name": "adamw", "cautious": True},
        {"name": "muon"},
        {"name": "muon", "cautious": True},
        {"name": "muon_plus", "muon_ns_schedule": "polar_express"},
    ],
    ids=["adamw-cautious", "muon", "muon-cautious", "muon_plus"],
)
def test_resume_is_bitwise_with_each_optimizer(tmp_path: Path, optimizer: dict[str, Any]) -> None:
    straight = Losses()
    whole = Trainer(tiny_run(tmp_path / "a", **optimizer), progress=False, hooks={"l": straight})
    whole.train()
    first, second = Losses(), Losses()
    Trainer(tiny_run(tmp_path / "b", **optimizer), progress=False, hooks={"l": first}).train(max_steps=3)
    resumed = Trainer(tiny_run(tmp_path / "b", **optimizer), progress=False, hooks={"l": second})
    assert resumed.step == 3
    resumed.train()
    assert first.values + second.values == straight.values
    for (name, a), b in zip(
        whole.raw_model.state_dict().items(), resumed.raw_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert straight.values[-1] < straight.values[0]


def test_train_cli_reports_the_routes(run_cli: Any, tmp_path: Path) -> None:
    config = tiny_run(tmp_path / "out", name="muon")
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json", exclude={"distributed": {"bus": {"token"}}})))
    result = run_cli("train", path, "--max-steps", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = route_parameters(build_model(config, 64)).counts()
    assert report["optimizer_routes"] == expected and expected["muon"] > 0 and expected["adamw"] > 0
    assert f"optimizer routes: muon {expected['muon']:,} parameters" in result.stderr


class Conv1D(nn.Module):
    """transformers' Conv1D (GPT-2): a Linear whose weight is stored (in, out). Routed by class name."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


@pytest.mark.parametrize(
    "fields",
    [
        {"muon_adjust_lr": "original"},
        {"muon_adjust_lr": "match_rms_adamw"},
        {"name": "muon_plus", "muon_adjust_lr": "original"},
    ],
)
def test_conv1d_weights_step_exactly_like_the_linear_they_transpose(fields: dict[str, Any]) -> None:
    """A Conv1D weight is a Linear weight stored transposed, so Muon must move it by exactly the
    transpose of the Linear's step: the LR scaling (rows/cols) and Muon+'s row/column
    normalisation belong to the (out, in) orientation, not to the storage."""
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(24, 8, bias=False))  # tall/wide: aspect ratio matters
    conv = nn.Sequential(Conv1D(24, 8))
    with torch.no_grad():
        conv[0].weight.copy_(linear[0].weight.T)
    routes = route_parameters(conv)
    assert routes.names()["muon"] == ["0.weight"] and routes.transposed == {"0.weight"}
    fields = {"name": "muon", "lr": 0.02, **fields}
    config = load_config({"optimizer": fields})
    opt_linear, opt_conv = build_optimizer(config, linear), build_optimizer(config, conv)
    for _ in range(3):
        x = torch.randn(5, 24)
        for model, opt in ((linear, opt_linear), (conv, opt_conv)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    torch.testing.assert_close(conv[0].weight, linear[0].weight.T, rtol=1e-5, atol=1e-6)
