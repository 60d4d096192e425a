"""Tests of the example-gru model (model.py): the trainer's forward contract, options, generation."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from speedtronic.config import ModelConfig

from speedtronic_example.model import GRULM, GRUOptions, build_gru

V, T = 32, 16


def tiny(**options: object) -> GRULM:
    torch.manual_seed(0)
    config = ModelConfig(
        name="example-gru", vocab_size=V, max_seq_len=T, d_model=16, n_layer=2, options=options
    )
    return build_gru(config)


def ids(batch: int = 2, seq: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_forward_returns_logits_and_unshifted_loss() -> None:
    model, x, y = tiny(), ids(), ids(seed=2)
    out = model(x, labels=y)
    assert out["logits"].shape == (2, T, V)
    # Labels are already shifted by the data pipeline: position t is scored against labels[t].
    expected = F.cross_entropy(out["logits"].reshape(-1, V), y.reshape(-1))
    torch.testing.assert_close(out["loss"], expected)
    assert "loss" not in model(x)


def test_ignored_labels_do_not_count() -> None:
    model, x, y = tiny(), ids(), ids(seed=2)
    masked = y.clone()
    masked[:, T // 2 :] = -100
    out = model(x, labels=masked)
    expected = F.cross_entropy(out["logits"][:, : T // 2].reshape(-1, V), y[:, : T // 2].reshape(-1))
    torch.testing.assert_close(out["loss"], expected)


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    model, x = tiny().eval(), ids()
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % V
    torch.testing.assert_close(model(x)["logits"][:, :10], model(changed)["logits"][:, :10])


def test_longer_than_max_seq_len_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny()(ids(seq=T + 1))


def test_options_hidden_size_and_tied_head() -> None:
    model = tiny(hidden_size=24)
    assert model.gru.hidden_size == 24
    assert model.head.weight is model.embed.weight  # the projection keeps the head tieable
    assert model(ids())["logits"].shape == (2, T, V)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hiden_size": 8}, "'hiden_size'"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_size": True}, "hidden_size"),
        ({"init_std": -1.0}, "init_std"),
    ],
)
def test_bad_options_are_errors_naming_the_key(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GRUOptions.parse(options)


def test_single_layer_with_dropout_does_not_warn() -> None:
    config = ModelConfig(name="example-gru", vocab_size=V, max_seq_len=T, d_model=16, n_layer=1, dropout=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nn.GRU warns about dropout with one layer; we must not pass it
        build_gru(config)


def test_greedy_generate_matches_rereading_the_whole_context() -> None:
    # generate() carries the GRU state; re-running forward on the growing sequence must agree.
    model, prompt = tiny().eval(), ids(batch=1, seq=4)
    out = model.generate(prompt, max_new_tokens=6, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)["logits"][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_reproducible_with_a_generator() -> None:
    model, prompt = tiny().eval(), ids(batch=1, seq=4)
    a = model.generate(prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 8, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (1, 12)


def test_loss_falls_on_a_fixed_batch() -> None:
    model, x, y = tiny(), ids(), ids(seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = model(x, labels=y)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
