"""The reference decoder-only transformer: a small, readable Llama-style language model.

Everything the trainer needs from a model lives in this one file, top to bottom:

    TransformerConfig  the hyperparameters, validated on construction
    RMSNorm            root-mean-square layer norm with a learnable gain (no bias, no mean-centring)
    Rotary             rotary position embeddings (RoPE), "rotate-half" convention as in Llama/HF
    Attention          causal multi-head attention with optional grouped-query attention (GQA)
    MLP                SwiGLU feed-forward: down(silu(gate(x)) * up(x))
    Block              pre-norm residual block: x + attn(norm1(x)), then x + mlp(norm2(x))
    Transformer        token embedding -> blocks -> final norm -> lm head (tied to the embedding by default)
    LayerKV, KVCache   the key/value cache `Transformer.forward_cached` keeps for incremental decoding

There are no biases anywhere and no learned position embeddings (RoPE supplies positions). Module
names follow Llama (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`) so
that exporting to Hugging Face format is a renaming exercise, not a reshaping one.

Initialisation (`Transformer.init_weights`, run by the constructor; deterministic under
`torch.manual_seed` because modules are visited in a fixed order):

* every `nn.Linear` and `nn.Embedding` weight ~ Normal(0, 0.02), as in GPT-2;
* the two projections that write into the residual stream, `o_proj` and `down_proj`, use
  std 0.02 / sqrt(2 * n_layer) instead. Each block adds two such outputs to the residual, so without
  the scaling the residual's variance grows with depth (GPT-2's "residual scaling");
* RMSNorm gains are ones, so every norm starts as a pure normalisation;
* with `tie_weights` the lm head *is* the embedding matrix and is initialised once, as the embedding.

The embedding and lm head carry `_speedtronic_optimizer_role = "adamw"`: optimizers that treat hidden
matrices specially (e.g. orthogonalised updates) route these two to AdamW instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from speedtronic.engine.decoding import SamplingSettings, stream_tokens

# Standard GPT-2 init scale; see the module docstring.
INIT_STD = 0.02


def _round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


@dataclass
class TransformerConfig:
    vocab_size: int = 256
    max_seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # None -> n_head (plain MHA); must divide n_head (GQA)
    d_model: int = 256
    d_ff: int | None = None  # None -> SwiGLU default: round_up(int(8/3 * d_model), 64)
    dropout: float = 0.0
    tie_weights: bool = True
    rope_base: float = 10000.0
    norm_eps: float = 1e-6  # RMSNorm epsilon (Hugging Face's rms_norm_eps)
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_head", "d_ff"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not self.rope_base > 0:
            raise ValueError(f"rope_base must be positive, got {self.rope_base!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be positive, got {self.norm_eps!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads != 0:
            raise ValueError(f"n_kv_head ({self.kv_heads}) must divide n_head ({self.n_head})")
        if self.head_dim % 2 != 0:
            # RoPE rotates pairs of channels, so each head needs an even number of them.
            raise ValueError(
                f"d_model / n_head (head_dim = {self.head_dim}) must be even for rotary embeddings; "
                f"change d_model ({self.d_model}) or n_head ({self.n_head})"
            )

    # The optional fields stay as given (None means "derive"), so `dataclasses.replace(cfg, d_model=...)`
    # re-derives them instead of silently keeping values computed for the old shape.
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads actually used (n_kv_head, or n_head when it is None)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU hidden width actually used. 8/3 * d_model keeps the parameter count of a 4x GELU
        MLP despite SwiGLU's third matrix; rounding to 64 keeps matmuls on efficient tile sizes."""
        return self.d_ff if self.d_ff is not None else _round_up(int(8 / 3 * self.d_model), 64)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight. Cheaper than LayerNorm and works as well for LMs."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embeddings (Su et al. 2021), Llama/HF "rotate-half" layout.

    Channel i of the first half of each head is paired with channel i of the second half, and the pair
    is rotated by angle pos * base^(-2i / head_dim). Rotating q and k by their absolute positions makes
    q.k depend only on the relative offset between them.
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.base = base
        # Non-persistent: derived from the config, so it has no business in a checkpoint.
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute the tables in float32; also needed after materialising a meta-device model."""
        device = self.cos.device
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.base**exponents)  # [head_dim/2]: fast rotation first, slowest last
        pos = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]: both halves of a pair share an angle
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, head_dim] by the per-position angles in cos/sin [T, head_dim]."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class LayerKV:
    """One layer's key/value cache for incremental decoding: post-rotary keys and values of the tokens seen
    so far, at most `capacity` positions. Written in place into buffers that take the dtype and device of
    the keys and double when full (a folder may declare a 128k-token window: allocating all of it up front
    would take gigabytes), so appending one token costs amortised O(1), not a copy of the cache."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add k, v [B, kv_heads, T, head_dim] at positions length .. length + T - 1."""
        end = self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {end} were asked for")
        if self._k is None or self._v is None or end > self._k.size(2):
            B, H, _, D = k.shape
            size = min(self.capacity, max(end, 64, 2 * (0 if self._k is None else self._k.size(2))))
            new_k, new_v = k.new_empty(B, H, size, D), v.new_empty(B, H, size, D)
            if self._k is not None and self._v is not None:
                new_k[:, :, : self.length] = self._k[:, :, : self.length]
                new_v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = new_k, new_v
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self.length = end

    def keys(self) -> torch.Tensor:
        assert self._k is not None
        return self._k[:, :, : self.length]

    def values(self) -> torch.Tensor:
        assert self._v is not None
        return self._v[:, :, : self.length]


class KVCache:
    """The whole model's cache (one LayerKV per block) as `Transformer.forward_cached` keeps it."""

    def __init__(self, n_layer: int, capacity: int) -> None:
        self.layers = [LayerKV(capacity) for _ in range(n_layer)]

    @property
    def length(self) -> int:
        """Positions cached so far: the position the next token will take."""
        return self.layers[0].length if self.layers else 0


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.kv_heads
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.q_proj = nn.Linear(config.d_model, self.n_head * self.head_dim, bias=False)
        # With GQA, groups of n_head / n_kv_head query heads share one key/value head: smaller k/v
        # projections here, and a much smaller KV cache at inference.
        self.k_proj = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, config.d_model, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        # [B, T, C] -> [B, heads, T, head_dim], the layout SDPA expects.
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        dropout_p = self.dropout if self.training else 0.0
        gqa = self.n_kv_head != self.n_head
        if kv is not None:
            start = kv.length
            kv.append(k, v)
            if start > 0:
                # Decoding: the new queries attend to every cached key plus the new ones. One query sees
                # all of them (no mask); several need the causal mask aligned to the end of the keys.
                k, v = kv.keys(), kv.values()
                mask = None
                if T > 1:
                    mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
                return self.resid_dropout(self.o_proj(y))
            # A prefill (empty cache) is the training computation below, so its logits are the forward's.
        if attn_mask is None:
            # Fast path: the flash kernel handles both causality and GQA itself.
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
        else:
            # SDPA's enable_gqa plus an explicit mask falls back to the O(T^2)-memory math kernel on GPU,
            # while the memory-efficient kernel accepts a mask with equal head counts: so expand K/V here.
            if gqa:
                rep = self.n_head // self.n_kv_head
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)

        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): a SiLU-gated linear unit, the Llama feed-forward."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.d_model, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class Block(nn.Module):
    """Pre-norm residual block. Normalising the branch inputs (not the residual) keeps an identity path
    from the embedding to the head, which is what makes deep stacks trainable without warm-up tricks."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None,
        kv: LayerKV | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, attn_mask, kv)
        x = x + self.mlp(self.norm2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.gradient_checkpointing = config.gradient_checkpointing
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.rotary = Rotary(config.head_dim, config.max_seq_len, config.rope_base)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            # One matrix both reads tokens in and scores them out: saves vocab * d_model parameters
            # and usually helps small models.
            self.lm_head.weight = self.tok_emb.weight
        self.tok_emb._speedtronic_optimizer_role = "adamw"
        self.lm_head._speedtronic_optimizer_role = "adamw"
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Apply the scheme in the module docstring (also usable after `to_empty` on a meta model)."""
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.lm_head and self.config.tie_weights:
                    continue  # the same tensor as tok_emb.weight, initialised there
                std = residual_std if name.endswith(("o_proj", "down_proj")) else INIT_STD
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Rotary):
                module.reset_parameters()

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in backward instead of storing them (training only)."""
        self.gradient_checkpointing = enabled

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """input_ids [B, T] -> {"logits": [B, T, vocab]} plus {"loss": scalar} when labels are given.

        `labels[b, t]` is the target for position t: the data pipeline has already shifted them, so no
        shifting happens here. Positions labelled -100 are ignored. `attention_mask` [B, T] marks real
        tokens with 1 and padding with 0 (Hugging Face convention); it is combined with the causal mask.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        seq_len = input_ids.size(1)
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len ({self.config.max_seq_len})")

        mask = None
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} must match input_ids "
                    f"{tuple(input_ids.shape)}"
                )
            # Boolean mask, True = may attend: key j is visible to query i if j <= i and j is a real token.
            # Every query may also always see itself, so a padded query with no real token before it
            # (left padding) still has one visible key: a fully masked softmax row would be NaN. Real
            # queries are unaffected, since their diagonal entry is already allowed.
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=input_ids.device).tril()
            diagonal = torch.eye(seq_len, dtype=torch.bool, device=input_ids.device)
            keys = attention_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, T], broadcast over heads
            mask = causal & (keys | diagonal)  # [B, 1, T, T]

        cos, sin = self.rotary(seq_len)
        x = self.tok_emb(input_ids)
        use_checkpoint = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if use_checkpoint:
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))

        out = {"logits": logits}
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels shape {tuple(labels.shape)} must match input_ids {tuple(input_ids.shape)}"
                )
            # float32 softmax: in bf16 the log-sum-exp over a large vocabulary loses too much precision.
            out["loss"] = F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100
            )
        return out

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Trainable parameter count; a tied lm head shares the embedding and is counted once.

        `exclude_embeddings` drops the token embedding (and so, when tied, the lm head too); an untied
        lm head is a real matmul and stays counted.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields each tensor once
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), the PaLM / nanoGPT MFU estimate.

        6 * N_matmul: each matmul weight costs 2 FLOPs per token forward (multiply + add) and 4 backward
        (grads w.r.t. input and weight). N_matmul counts every Linear weight, lm head included even when
        tied (it is still a matmul), but not the embedding lookup or norms.
        12 * n_layer * n_head * head_dim * seq_len: the QK^T and attention-times-V matmuls, which have no
        weights; seq_len here is the full context (no causal discount), as in PaLM.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        n_matmul = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        c = self.config
        return float(6 * n_matmul + 12 * c.n_layer * c.n_head * c.head_dim * seq_len)

    @torch.no_grad()
    def forward_cached(
        self, input_ids: torch.Tensor, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        """Incremental decoding (the engine's KV-cache contract, engine/decoding.py): input_ids [B, T] are
        the tokens after those in `cache` (None: a new sequence starting at position 0); returns the last
        position's logits [B, vocab] and the cache, now holding them too.

        Positions continue from the cache, so the rotary angles are those the full forward would give;
        `cache.length + T` must stay within max_seq_len (the caller re-prefills past the window). A
        prefill runs the blocks exactly as `forward` does. For inference: no gradients, and call it in eval
        mode (`generate` does), or dropout applies.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if cache is None:
            cache = KVCache(self.config.n_layer, self.config.max_seq_len)
        start, end = cache.length, cache.length + input_ids.size(1)
        if end > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {end} exceeds max_seq_len ({self.config.max_seq_len}); "
                "re-prefill the last max_seq_len tokens with cache=None"
            )
        cos, sin = self.rotary.cos[start:end], self.rotary.sin[start:end]
        x = self.tok_emb(input_ids)
        for block, kv in zip(self.blocks, cache.layers, strict=True):
            x = block(x, cos, sin, None, kv)
        return self.lm_head(self.norm(x[:, -1:, :]))[:, 0, :], cache

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        *,
        top_p: float | None = None,
        repetition_penalty: float = 1.0,
        repetition_window: int | None = None,
        use_cache: bool = True,
        window_refill: int | None = None,
    ) -> torch.Tensor:
        """Autoregressively append max_new_tokens tokens to input_ids [B, T]; returns [B, T + new].

        With `use_cache` (the default) the prompt is prefilled once into a KV cache and each step feeds
        one token; without it each step reruns the (cropped) context. Both give the same tokens up to
        float rounding (tests/test_sampling_cache.py); past max_seq_len (and for `window_refill`) see
        engine/decoding.py.
        temperature == 0 means greedy argmax; otherwise sample from softmax(logits / temperature),
        optionally restricted to the top_k most likely tokens and/or the top_p nucleus, drawing from
        `generator`; repetition_penalty > 1 discourages tokens already in the sequence (or in its last
        repetition_window tokens), greedy too.
        Runs in eval mode (no dropout) and restores the previous mode afterwards.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        settings = SamplingSettings(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
            repetition_window=repetition_window,
            window_refill=window_refill,
        )
        was_training = self.training
        self.eval()
        try:
            stream = stream_tokens(
                self,
                input_ids,
                settings,
                max_seq_len=self.config.max_seq_len,
                generator=generator,
                use_cache=use_cache,
            )
            new = list(stream)
        finally:
            self.train(was_training)
        return torch.cat([input_ids, *new], dim=1)
