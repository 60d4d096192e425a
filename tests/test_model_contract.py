"""The architecture-neutral model contract and the typed model configs, through the public API.

- models: `forward(x)` returning logits, `forward(input_ids, labels)`, `forward(**batch)` and an
  HF-style output object all train; a batch `(inputs, labels, extra)` hands `extra` to the forward's
  next positional parameter (and is ignored by one that has none);
- hooks: a generic `on_event(event, payload)` receives every event;
- config: `optimizer: muon` / `model: transformer` shorthands, `ConfigError` is a `ValueError`,
  `Config.from_yaml` / `to_dict(redact=True)` / `save` round trip with the token never written;
- the built-in transformer is an ordinary registration with a typed config, and a plugin model's
  typed config validates `model:` (a bad field is one line naming it, exit 2).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from speedtronic import Config, Trainer, hookimpl, load_config
from speedtronic.config.models import BaseModelConfig, ModelConfig
from speedtronic.engine.batches import accepts_labels, batch_tokens, forward_spec, split_batch
from speedtronic.engine.events import EVENTS
from speedtronic.errors import ConfigError
from speedtronic.plugins import PluginHost
from speedtronic.registry import PluginError

pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

VOCAB = 32


def tiny(tmp_path: Path, **sections: Any) -> Config:
    base: dict[str, Any] = {
        "run": {"name": "c", "max_steps": 12, "log_every": 1, "eval_every": 0, "output_dir": str(tmp_path)},
        "model": {"n_layer": 1, "n_head": 2, "d_model": 16},
        "data": {
            "synthetic": True,
            "vocab_size": VOCAB,
            "num_tokens": 5_000,
            "block_size": 8,
            "micro_batch_size": 4,
            "val_batches": 1,
        },
        "optimizer": {"lr": 1e-2},
        "checkpoint": {"enabled": False},
        "logging": {"hooks": []},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return load_config(base)


class Recorder:
    """A hook with only the generic method: it must receive every event."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def on_event(self, event: str, payload: dict[str, Any]) -> None:
        self.events.append((event, payload))

    def losses(self) -> list[float]:
        return [p["loss"] for e, p in self.events if e == "step"]


def batches(n: int = 6, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # A learnable pattern: each token is the previous one plus one, so the loss really falls.
    starts = torch.randint(0, VOCAB, (n, 4, 1), generator=generator)
    return [(s + torch.arange(9)) % VOCAB for s in starts]


class Logits(nn.Module):
    """forward(x): one positional parameter that is not called input_ids, returning logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def train_losses(
    tmp_path: Path, model: nn.Module, data: list[Any], steps: int = 12
) -> tuple[list[float], Any]:
    recorder = Recorder()
    config = tiny(tmp_path, run={"max_steps": steps}, data={"micro_batch_size": 4})
    trainer = Trainer(
        config, model=model, train_data=data, val_data=data[:1], hooks={"rec": recorder}, progress=False
    )
    result = trainer.train()
    losses = recorder.losses()
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
    return losses, result


def test_forward_x_returning_logits_trains(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Logits()
    assert not accepts_labels(model) and forward_spec(model).positional
    data = [(t[:, :-1], t[:, 1:]) for t in batches()]
    losses, result = train_losses(tmp_path, model, data)
    assert losses[-1] < losses[0]
    assert result.tokens == 12 * 4 * 8


def test_forward_input_ids_labels_and_forward_kwargs_train(tmp_path: Path) -> None:
    class WithLabels(Logits):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            logits = self.head(self.embed(input_ids))
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    class Kwargs(Logits):
        def forward(self, **batch: torch.Tensor) -> Any:
            assert set(batch) == {"input_ids", "labels", "attention_mask"}  # every key, by name
            logits = self.head(self.embed(batch["input_ids"]))
            return {"loss": F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))}

    for index, cls in enumerate((WithLabels, Kwargs)):
        torch.manual_seed(0)
        model = cls()
        assert accepts_labels(model)
        data = [
            {"input_ids": t[:, :-1], "labels": t[:, 1:], "attention_mask": torch.ones(4, 8)}
            for t in batches()
        ]
        losses, _ = train_losses(tmp_path / str(index), model, data)
        assert losses[-1] < losses[0], cls.__name__


def test_tuple_batch_extra_goes_to_the_next_positional_parameter(tmp_path: Path) -> None:
    seen: list[torch.Tensor] = []

    class Weighted(Logits):
        def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            seen.append(weights)
            return self.head(self.embed(x)) * weights[..., None]

    torch.manual_seed(0)
    data = [(t[:, :-1], t[:, 1:], torch.full((4, 8), 2.0)) for t in batches()]
    assert split_batch(data[0])[0]["input_ids"] is data[0][0] and batch_tokens(data[0]) == 32
    losses, _ = train_losses(tmp_path / "w", Weighted(), data, steps=6)
    assert seen and all(torch.equal(w, torch.full((4, 8), 2.0)) for w in seen)
    assert losses[-1] != losses[0]
    # A forward with no parameter for it ignores the extra item.
    losses, _ = train_losses(tmp_path / "l", Logits(), data, steps=6)
    assert losses[-1] < losses[0]


def test_hf_style_output_object_trains(tmp_path: Path) -> None:
    @dataclass
    class Output:  # like transformers' ModelOutput seen by attribute: loss may be None
        logits: torch.Tensor
        loss: torch.Tensor | None = None

    class HFStyle(Logits):
        def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> Output:
            return Output(logits=self.head(self.embed(input_ids)))

    torch.manual_seed(0)
    data = [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in batches()]
    losses, _ = train_losses(tmp_path, HFStyle(), data)
    assert losses[-1] < losses[0]


def test_on_event_hook_receives_every_event(tmp_path: Path) -> None:
    recorder = Recorder()
    config = tiny(
        tmp_path, run={"max_steps": 4, "eval_every": 2}, checkpoint={"enabled": True, "every_steps": 2}
    )
    Trainer(config, hooks={"rec": recorder}, progress=False).train()
    names = [e for e, _ in recorder.events]
    assert set(names) == set(EVENTS)
    assert names[0] == "train_start" and names[-1] == "train_end"
    assert [p["step"] for e, p in recorder.events if e == "step_end"] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------- config
def test_named_section_shorthands(tmp_path: Path) -> None:
    config = load_config({"optimizer": "muon", "model": "transformer"})
    assert config.optimizer.name == "muon" and config.model.name == "transformer"
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: muon\nmodel: transformer\n")
    assert Config.from_yaml(path, ["optimizer.lr=0.01"]).optimizer.lr == 0.01  # --set into a shorthand
    assert Config.model_validate({"optimizer": "muon"}).optimizer.name == "muon"


def test_config_error_is_a_value_error() -> None:
    assert isinstance(ConfigError("x"), ValueError)
    with pytest.raises(ValueError, match=r"model\.n_head"):
        load_config({"model": {"n_head": 0}})


def test_from_yaml_to_dict_save_round_trip(tmp_path: Path) -> None:
    token = "hf_contractRoundTripSecret42"
    source = tmp_path / "in.yaml"
    source.write_text("model: {n_layer: 2, d_model: 64}\noptimizer: muon\n")
    config = Config.from_yaml(source, ["distributed.bus.token=" + token, "run.name=trip"])
    assert config.to_dict()["distributed"]["bus"]["token"] == "**********"
    assert config.to_dict(redact=False)["distributed"]["bus"]["token"] == token
    saved = config.save(tmp_path / "out" / "saved.yaml")
    text = saved.read_text()
    assert token not in text
    again = Config.from_yaml(saved)
    assert again.distributed.bus.token is None  # secrets are never written: the token is redacted
    assert again.model_copy(update={"distributed": config.distributed}) == config
    plain = Config.from_yaml(source)
    assert Config.from_yaml(plain.save(tmp_path / "plain.yaml")) == plain


def test_transformer_options_are_refused_at_validation() -> None:
    with pytest.raises(ConfigError, match=r"model.options is not used by the transformer: \['depth'\]"):
        load_config({"model": {"options": {"depth": 3}}})
    assert load_config({"model": {"options": {}}}).model.name == "transformer"  # what old dumps hold


# ------------------------------------------------------------------------------ typed model configs
class WideConfig(BaseModelConfig):
    """A plugin model's own config."""

    width: int = Field(8, gt=0, description="Hidden width.")
    depth: int = Field(1, gt=0, le=4, description="Layers.")


class WidePlugin:
    @hookimpl
    def register_models(self, register: Any) -> None:
        register("wide", self.build, config=WideConfig)

    @staticmethod
    def build(config: WideConfig) -> nn.Module:
        assert isinstance(config, WideConfig)  # the factory gets its own class, never the generic one
        return nn.Sequential(
            nn.Embedding(config.vocab_size or VOCAB, config.width), nn.Linear(config.width, VOCAB)
        )


def test_builtin_transformer_is_a_typed_registration() -> None:
    from speedtronic.builtin.models import TransformerModelConfig
    from speedtronic.registry import builtin_registries

    entry = builtin_registries().models.entry("transformer")
    assert entry.config is TransformerModelConfig and entry.plugin == "speedtronic.builtin.models"
    assert type(load_config({}).model) is TransformerModelConfig


def test_plugin_typed_config_validates_the_model_section(tmp_path: Path) -> None:
    host = PluginHost(load_installed=False)
    host.register(WidePlugin(), name="wide-plugin")
    registries = host.registries()
    config = load_config({"model": {"name": "wide", "width": 12}}, registries=registries)
    assert type(config.model) is WideConfig and config.model.width == 12
    with pytest.raises(ConfigError) as error:
        load_config({"model": {"name": "wide", "depth": 9}}, registries=registries)
    assert str(error.value) == "invalid config: model.depth: Input should be less than or equal to 4 (got 9)"
    with pytest.raises(ConfigError, match=r"model.widht: unknown key; did you mean 'model.width'\?"):
        load_config({"model": {"name": "wide", "widht": 3}}, registries=registries)
    # Loaded without these registries the section is the generic one; building validates it again.
    from speedtronic.engine.build import instantiate_model

    model = instantiate_model(ModelConfig(name="wide", vocab_size=VOCAB), registries)
    assert isinstance(model, nn.Sequential)


def test_memory_check_asks_the_model_config_and_names_its_field() -> None:
    from speedtronic.plan import DataFacts, DeviceFacts, plan_run

    small = DeviceFacts("cpu", memory_bytes=2**30)
    with pytest.raises(ConfigError, match=r"^model\.d_model: 65,536 makes this run need at least"):
        plan_run(
            load_config({"model": {"d_model": 2**16, "n_head": 4}}), data=DataFacts(256, None), device=small
        )

    class Big(WideConfig):
        memory_fields: ClassVar[tuple[str, ...]] = ("width",)

        def estimate_memory(self, vocab_size: int, rows: int) -> int | None:
            return 4 * self.width * vocab_size

    class BigPlugin(WidePlugin):
        @hookimpl
        def register_models(self, register: Any) -> None:
            register("big", self.build, config=Big)

    host = PluginHost(load_installed=False)
    host.register(BigPlugin(), name="big-plugin")
    config = load_config({"model": {"name": "big", "width": 2**24}}, registries=host.registries())
    with pytest.raises(ConfigError, match=r"^model\.width: 16,777,216 makes this run need"):
        plan_run(config, data=DataFacts(256, None), device=small)
    # A model whose config gives no estimate is not checked (the generic section gives none).
    plan_run(
        load_config({"model": {"name": "nobody-registered", "d_model": 2**16}}),
        data=DataFacts(256, None),
        device=small,
    )


def test_memory_plan_takes_optimizer_state_from_the_registration(tmp_path: Path) -> None:
    from speedtronic.engine.preflight.memory_plan import memory_plan

    class Stateless:
        @hookimpl
        def register_optimizers(self, register: Any) -> None:
            register(
                "sgd-plain",
                lambda model, cfg: torch.optim.SGD(model.parameters(), lr=cfg.lr),
                state_elements=0,
            )

    host = PluginHost(load_installed=False)
    host.register(Stateless(), name="stateless")
    plans = {
        name: memory_plan(tiny(tmp_path, optimizer={"name": name}), registries=host.registries())
        for name in ("sgd-plain", "adamw", "muon")
    }
    params = plans["adamw"]["parameters"]
    assert plans["sgd-plain"]["strategies"]["ddp"]["optimizer"] == 0
    assert plans["adamw"]["strategies"]["ddp"]["optimizer"] == 2 * params * 4
    assert 0 < plans["muon"]["strategies"]["ddp"]["optimizer"] < 2 * params * 4


def test_a_model_registration_may_only_declare_a_model_config() -> None:
    class Bad:
        @hookimpl
        def register_models(self, register: Any) -> None:
            register("bad", lambda config: nn.Linear(1, 1), config=dict)

    host = PluginHost(load_installed=False)
    host.register(Bad(), name="bad-plugin")
    with pytest.raises(PluginError, match=r"config= must be a subclass of .*BaseModelConfig"):
        host.registries()


def test_no_name_switch_on_transformer_in_engine_plan_or_config() -> None:
    root = Path(__file__).resolve().parents[1] / "src" / "speedtronic"
    files = [root / "plan.py", *(root / "engine").rglob("*.py"), *(root / "config").glob("*.py")]
    offenders = [
        f"{path.name}:{number}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if '== "transformer"' in line or '!= "transformer"' in line or 'in ("muon"' in line
    ]
    assert offenders == []


EXAMPLE = """
import sys
from speedtronic.cli import main
sys.argv = ["speedtronic", "validate", sys.argv[1]]
main()
"""


def test_example_plugin_typed_config_error_names_the_field(tmp_path: Path) -> None:
    """The example plugin's example-mlp: a bad value of one of its fields is one line naming it, exit 2."""
    path = tmp_path / "mlp.yaml"
    path.write_text("model: {name: example-mlp, context: 0}\ndata: {synthetic: true}\n")
    plugin_src = Path(__file__).resolve().parents[1] / "plugins" / "speedtronic-example" / "src"
    env_path = f"{Path(__file__).resolve().parents[1] / 'src'}:{plugin_src}"
    result = subprocess.run(
        [sys.executable, "-c", EXAMPLE, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": env_path,
            "SPEEDTRONIC_LOAD_PLUGINS": "speedtronic-example",
            "HF_HOME": str(tmp_path / "hf"),
            "COLUMNS": "200",
        },
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "model.context" in line]
    assert len(errors) == 1 and "greater than 0" in errors[0], result.stderr
