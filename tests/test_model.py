"""Tests for the reference transformer (speedtronic.engine.model). Tiny dims keep the file fast on CPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speedtronic.engine.model import Rotary, Transformer, TransformerConfig, apply_rotary

V = 64


def tiny_config(**overrides: object) -> TransformerConfig:
    base = dict(vocab_size=V, max_seq_len=16, n_layer=2, n_head=4, d_model=32)
    base.update(overrides)
    return TransformerConfig(**base)  # type: ignore[arg-type]


def tiny_model(seed: int = 0, **overrides: object) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny_config(**overrides))


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, seq), generator=g)


# ---------------------------------------------------------------------------------------------- config


def test_config_defaults_resolve() -> None:
    cfg = TransformerConfig()
    assert cfg.kv_heads == cfg.n_head == 4
    assert cfg.head_dim == 64
    assert cfg.ffn_dim == 704  # int(8/3 * 256) = 682, rounded up to a multiple of 64
    assert cfg.n_kv_head is None and cfg.d_ff is None  # left as given, derived on read
    # Derived values follow a replace() instead of keeping the old shape's numbers.
    assert dataclasses.replace(cfg, d_model=128).ffn_dim == 384
    assert tiny_config(d_ff=48).ffn_dim == 48


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"n_kv_head": 3}, "n_kv_head"),
        ({"n_kv_head": 0}, "n_kv_head"),
        ({"d_model": 30}, "d_model"),
        ({"d_model": 36, "n_head": 4}, "head_dim"),  # head_dim 9 is odd: RoPE needs pairs
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_layer": -1}, "n_layer"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"d_ff": 0}, "d_ff"),
        ({"dropout": 1.0}, "dropout"),
        ({"rope_base": 0.0}, "rope_base"),
    ],
)
def test_config_rejects_invalid(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


# ---------------------------------------------------------------------------------------- shapes, loss


def test_logits_shape_and_loss_near_uniform_at_init() -> None:
    model = tiny_model()
    ids = random_ids(4, 16)
    out = model(ids, labels=random_ids(4, 16, seed=2))
    assert out["logits"].shape == (4, 16, V)
    assert out["loss"].dim() == 0
    # Small init -> near-uniform predictions -> loss close to ln(V).
    assert abs(out["loss"].item() - math.log(V)) < 0.3
    assert set(model(ids)) == {"logits"}


def test_loss_is_plain_cross_entropy_without_shift() -> None:
    model = tiny_model()
    ids, labels = random_ids(2, 12), random_ids(2, 12, seed=3)
    out = model(ids, labels=labels)
    logits = out["logits"]
    expected = F.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))
    torch.testing.assert_close(out["loss"], expected)
    shifted = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    assert not torch.allclose(out["loss"], shifted)
    assert out["loss"].dtype == torch.float32


def test_loss_ignores_minus_100() -> None:
    model = tiny_model()
    ids, labels = random_ids(2, 12), random_ids(2, 12, seed=3)
    labels[0, :5] = -100
    labels[1, 7:] = -100
    out = model(ids, labels=labels)
    keep = labels != -100
    expected = F.cross_entropy(out["logits"][keep].float(), labels[keep])
    torch.testing.assert_close(out["loss"], expected)


def test_rejects_sequence_longer_than_max_seq_len() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(random_ids(1, 17))


def test_causality() -> None:
    model = tiny_model().eval()
    ids = random_ids(2, 12)
    t = 7
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % V
    a, b = model(ids)["logits"], model(changed)["logits"]
    torch.testing.assert_close(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t], b[:, t])


# ------------------------------------------------------------------------------------------------ GQA


@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_gqa(n_kv_head: int) -> None:
    model = tiny_model(n_kv_head=n_kv_head).eval()
    attn = model.blocks[0].attn
    assert attn.k_proj.out_features == n_kv_head * 8
    assert attn.v_proj.out_features == n_kv_head * 8
    assert attn.q_proj.out_features == 32
    ids = random_ids(2, 10)
    out = model(ids, labels=ids)
    assert out["logits"].shape == (2, 10, V)
    out["loss"].backward()
    # The masked path expands K/V by hand instead of using enable_gqa: both must agree.
    masked = model(ids, attention_mask=torch.ones_like(ids))["logits"]
    torch.testing.assert_close(masked, out["logits"])


def test_gqa_with_one_group_per_head_matches_mha_weights() -> None:
    # n_kv_head == n_head is plain MHA: same parameter shapes, same init, same outputs.
    a, b = tiny_model(n_kv_head=4).eval(), tiny_model().eval()
    ids = random_ids(1, 8)
    torch.testing.assert_close(a(ids)["logits"], b(ids)["logits"])


# ---------------------------------------------------------------------------------------- weight tying


def test_tied_weights_counted_once() -> None:
    model = tiny_model(tie_weights=True)
    assert model.lm_head.weight is model.tok_emb.weight
    n = model.num_parameters()
    assert n == sum(p.numel() for p in set(model.parameters()))
    untied = tiny_model(tie_weights=False)
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert untied.num_parameters() == n + V * 32
    # exclude_embeddings drops the embedding; an untied head is a real matmul and stays.
    assert model.num_parameters(exclude_embeddings=True) == n - V * 32
    assert untied.num_parameters(exclude_embeddings=True) == n


def test_optimizer_roles_and_init_scheme() -> None:
    model = tiny_model(n_layer=8, d_model=64)
    assert model.tok_emb._speedtronic_optimizer_role == "adamw"
    assert model.lm_head._speedtronic_optimizer_role == "adamw"
    assert not hasattr(model.blocks[0].attn.q_proj, "_speedtronic_optimizer_role")
    assert not any("bias" in name for name, _ in model.named_parameters())
    block = model.blocks[0]
    assert torch.equal(block.norm1.weight, torch.ones(64))
    assert torch.equal(model.norm.weight, torch.ones(64))
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002
    assert abs(block.attn.q_proj.weight.std().item() - 0.02) < 0.002
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert abs(block.attn.o_proj.weight.std().item() - residual_std) < 0.001
    assert abs(block.mlp.down_proj.weight.std().item() - residual_std) < 0.001
    # RoPE tables are derived, not state.
    assert not any("rotary" in k for k in model.state_dict())


def test_init_deterministic_under_seed() -> None:
    a, b, c = tiny_model(seed=5), tiny_model(seed=5), tiny_model(seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["tok_emb.weight"], sc["tok_emb.weight"])


# ------------------------------------------------------------------------------------------------ RoPE


def test_rotary_scores_depend_only_on_relative_position() -> None:
    rot = Rotary(head_dim=8, max_seq_len=32, base=10000.0)
    cos, sin = rot(32)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)
    qs = apply_rotary(q.expand(1, 1, 32, 8), cos, sin)[0, 0]
    ks = apply_rotary(k.expand(1, 1, 32, 8), cos, sin)[0, 0]
    # <q at m, k at n> must equal <q at m+s, k at n+s>.
    torch.testing.assert_close(qs[5] @ ks[2], qs[20] @ ks[17])
    torch.testing.assert_close(qs[0] @ ks[0], q @ k)  # position 0 is the identity rotation
    assert not torch.allclose(qs[5] @ ks[2], qs[5] @ ks[4])


# -------------------------------------------------------------------------------------- attention mask


def test_all_ones_mask_matches_no_mask() -> None:
    model = tiny_model().eval()
    ids = random_ids(3, 12)
    torch.testing.assert_close(
        model(ids, attention_mask=torch.ones_like(ids))["logits"], model(ids)["logits"]
    )


def test_right_padding_keeps_real_prefix_logits() -> None:
    model = tiny_model().eval()
    real = random_ids(1, 7)
    padded = torch.cat([real, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 7), torch.zeros(1, 5)], dim=1).long()
    other = random_ids(1, 12, seed=9)  # a second, unpadded row in the same batch
    batch = torch.cat([padded, other])
    batch_mask = torch.cat([mask, torch.ones(1, 12, dtype=torch.long)])
    out = model(batch, attention_mask=batch_mask)["logits"]
    torch.testing.assert_close(out[0, :7], model(real)["logits"][0])
    torch.testing.assert_close(out[1], model(other)["logits"][0])


def test_padding_with_zeros_never_gives_nan() -> None:
    model = tiny_model().train()
    ids = random_ids(3, 10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: the first query rows have no real key before them
    mask[1, 6:] = 0  # right padding
    mask[2, :] = 0  # a fully padded row
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, labels=labels, attention_mask=mask)
    assert torch.isfinite(out["logits"]).all()
    assert torch.isfinite(out["loss"])
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    # Bool and float masks are accepted too.
    for m in (mask.bool(), mask.float()):
        torch.testing.assert_close(model.eval()(ids, attention_mask=m)["logits"], out["logits"].detach())


def test_mask_shape_mismatch_raises() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="attention_mask"):
        model(random_ids(2, 8), attention_mask=torch.ones(2, 7))


# ------------------------------------------------------------------------------ training and gradients


def test_backward_gives_finite_grads_everywhere() -> None:
    model = tiny_model(tie_weights=False)
    ids = random_ids(2, 16)
    model(ids, labels=random_ids(2, 16, seed=4))["loss"].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_gradient_checkpointing_matches_and_toggles() -> None:
    ids, labels = random_ids(2, 16), random_ids(2, 16, seed=4)

    def run(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        calls = 0

        def count(*_: object) -> None:
            nonlocal calls
            calls += 1

        handle = model.blocks[0].register_forward_pre_hook(count)
        loss = model(ids, labels=labels)["loss"]
        loss.backward()
        handle.remove()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, calls

    plain = tiny_model().train()
    ckpt = tiny_model(gradient_checkpointing=True).train()
    loss_a, grads_a, calls_a = run(plain)
    loss_b, grads_b, calls_b = run(ckpt)
    torch.testing.assert_close(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-6)
    # Checkpointing reruns each block's forward during backward. (A pre-hook counts it: with early
    # stopping the recomputation can end before a post-forward hook would fire.)
    assert (calls_a, calls_b) == (1, 2)

    ckpt.set_gradient_checkpointing(False)
    ckpt.zero_grad()
    assert run(ckpt)[2] == 1
    plain.set_gradient_checkpointing(True)
    plain.zero_grad()
    assert run(plain)[2] == 2
    # No recomputation outside training.
    plain.eval()
    plain.zero_grad()
    assert run(plain)[2] == 1


def test_dropout_only_in_training() -> None:
    model = tiny_model(dropout=0.5)
    ids = random_ids(1, 8)
    model.train()
    assert not torch.allclose(model(ids)["logits"], model(ids)["logits"])
    model.eval()
    torch.testing.assert_close(model(ids)["logits"], model(ids)["logits"])


def test_adamw_overfits_fixed_batch() -> None:
    model = tiny_model()
    ids, labels = random_ids(2, 16), random_ids(2, 16, seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(25):
        loss = model(ids, labels=labels)["loss"]
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = model(ids, labels=labels)["loss"].item()
    assert final < 0.5 * first


# ----------------------------------------------------------------------------------------------- flops


def test_flops_per_token_formula() -> None:
    d, ff, L, H, kv, hd, T = 32, 128, 2, 4, 2, 8, 16
    model = tiny_model(n_kv_head=kv)
    assert model.config.ffn_dim == ff
    per_layer = d * d + 2 * d * kv * hd + d * d + 3 * d * ff  # q, k+v, o, gate+up+down
    n_matmul = L * per_layer + V * d  # lm head counted even though tied
    expected = 6 * n_matmul + 12 * L * H * hd * T
    assert model.flops_per_token(T) == pytest.approx(expected)
    assert model.flops_per_token(T) > 0
    assert model.flops_per_token(2 * T) > model.flops_per_token(T)
    assert sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)) == n_matmul


# -------------------------------------------------------------------------------------------- generate


def test_greedy_generation_is_deterministic() -> None:
    model = tiny_model().train()
    prompt = random_ids(2, 5)
    a = model.generate(prompt, max_new_tokens=6, temperature=0.0)
    b = model.generate(prompt, max_new_tokens=6, temperature=0.0)
    assert a.shape == (2, 11)
    assert torch.equal(a, b)
    assert torch.equal(a[:, :5], prompt)
    assert model.training  # mode restored
    # top_k=1 sampling is greedy too; the first new token is the argmax of the prompt's last logits.
    torch.testing.assert_close(model.generate(prompt, 6, temperature=1.0, top_k=1), a)
    assert torch.equal(a[:, 5], model.eval()(prompt)["logits"][:, -1].argmax(-1))


def test_sampling_reproducible_with_generator() -> None:
    model = tiny_model()
    prompt = random_ids(2, 3)

    def sample(seed: int) -> torch.Tensor:
        return model.generate(
            prompt, 10, temperature=1.5, top_k=20, generator=torch.Generator().manual_seed(seed)
        )

    a, b = sample(0), sample(0)
    assert torch.equal(a, b)
    assert a.shape == (2, 13)
    assert ((a >= 0) & (a < V)).all()
    assert any(not torch.equal(a, sample(s)) for s in range(1, 4))


def test_generation_crops_long_context() -> None:
    model = tiny_model()  # max_seq_len 16
    prompt = random_ids(1, 20)
    out = model.generate(prompt, max_new_tokens=3, temperature=0.0)
    assert out.shape == (1, 23)
    assert torch.equal(out[:, :20], prompt)
    # Only the last max_seq_len tokens matter.
    cropped = model.generate(prompt[:, -16:], max_new_tokens=3, temperature=0.0)
    assert torch.equal(out[:, -3:], cropped[:, -3:])


def test_generate_rejects_bad_arguments() -> None:
    model = tiny_model()
    prompt = random_ids(1, 3)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(prompt, 2, top_k=0)
    assert torch.equal(model.generate(prompt, 0), prompt)
