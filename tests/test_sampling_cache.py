"""Sampling with a KV cache: the cached loop gives the tokens full-context sampling gives (greedy and
seeded sampling, within and past the context window, MHA and GQA), models without a cache fall back,
top-p and the repetition penalty do what they say, text streams piece by piece, and `speedtronic sample`
reports tokens_per_s (real subprocesses on a tiny trained checkpoint and its exported folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import speedtronic
from speedtronic.engine.checkpoint.load_run import load_run
from speedtronic.engine.data import ByteTokenizer
from speedtronic.engine.decoding import SamplingSettings, next_token, supports_kv_cache
from speedtronic.engine.model import Transformer, TransformerConfig
from speedtronic.engine.sampling import TextStream, generate_tokens, run_sampling

SRC = Path(speedtronic.__file__).resolve().parents[1]
V = 64


def tiny(n_kv_head: int | None = None, max_seq_len: int = 24, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(
        TransformerConfig(
            vocab_size=V, max_seq_len=max_seq_len, n_layer=2, n_head=4, n_kv_head=n_kv_head, d_model=32
        )
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)  # sharper than the 0.02 init, so attention (and RoPE offsets) matter
    return model.eval()


def prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------- the model's cache


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_forward_cached_matches_the_full_forward_at_every_position(n_kv_head: int | None) -> None:
    model = tiny(n_kv_head)
    ids = prompt(2, 24)
    with torch.no_grad():
        full = model(ids)["logits"]
    logits, cache = model.forward_cached(ids[:, :7])  # prefill
    torch.testing.assert_close(logits, full[:, 6], rtol=1e-5, atol=1e-5)
    assert cache.length == 7
    for t in range(7, 12):  # one token at a time: rotary angles continue at the cache's position
        logits, cache = model.forward_cached(ids[:, t : t + 1], cache)
        torch.testing.assert_close(logits, full[:, t], rtol=1e-5, atol=1e-5)
    logits, cache = model.forward_cached(ids[:, 12:24], cache)  # a chunk on top of a cache: causal mask
    torch.testing.assert_close(logits, full[:, 23], rtol=1e-5, atol=1e-5)
    assert cache.length == 24
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model.forward_cached(ids[:, :1], cache)


def test_the_cache_grows_as_it_fills_and_stays_exact() -> None:
    model = tiny(2, max_seq_len=160)
    ids = prompt(1, 160)
    with torch.no_grad():
        full = model(ids)["logits"]
    logits, cache = model.forward_cached(ids[:, :3])
    sizes = {cache.layers[0]._k.size(2)}
    for t in range(3, 160):  # buffers of 64, then 128, then the 160 the window allows
        logits, cache = model.forward_cached(ids[:, t : t + 1], cache)
        torch.testing.assert_close(logits, full[:, t], rtol=1e-5, atol=1e-5)
        sizes.add(cache.layers[0]._k.size(2))
    assert sizes == {64, 128, 160}


@pytest.mark.parametrize("n_kv_head", [None, 2])
@pytest.mark.parametrize("prompt_len", [1, 5, 30])  # 30 > max_seq_len 24: cropped from the start
def test_cached_greedy_tokens_equal_full_context_greedy_tokens(
    n_kv_head: int | None, prompt_len: int
) -> None:
    model = tiny(n_kv_head)
    ids = prompt(2, prompt_len)
    # 40 new tokens run well past the 24-token window, through the re-prefill.
    cached = model.generate(ids, 40, temperature=0.0)
    full = model.generate(ids, 40, temperature=0.0, use_cache=False)
    assert torch.equal(cached, full)
    assert cached.shape == (2, prompt_len + 40) and torch.equal(cached[:, :prompt_len], ids)


def test_cached_sampling_equals_full_context_sampling_for_a_seed() -> None:
    model = tiny(2)
    ids = prompt(3, 4)
    for settings in (
        {"temperature": 1.0},
        {"temperature": 0.9, "top_k": 10},
        {"temperature": 1.2, "top_p": 0.8},
        {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3},
    ):
        runs = [
            model.generate(ids, 30, generator=torch.Generator().manual_seed(5), use_cache=use, **settings)
            for use in (True, False, True)
        ]
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2]), settings
    other = model.generate(ids, 30, temperature=1.0, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(
        other, model.generate(ids, 30, temperature=1.0, generator=torch.Generator().manual_seed(5))
    )


def test_the_cache_only_runs_the_newest_token_through_the_model() -> None:
    model = tiny(max_seq_len=16)
    seen: list[int] = []
    model.tok_emb.register_forward_hook(lambda _module, args, _out: seen.append(args[0].size(1)))
    model.generate(prompt(1, 6), 14, temperature=0.0)
    # Prefill 6, then 1 per token while it fits (6 + 9 = 15 tokens cached, the 16th fills the window),
    # then past the window the last 16 tokens are prefilled again for each token.
    assert seen == [6] + [1] * 10 + [16] * 3
    seen.clear()
    model.generate(prompt(1, 6), 3, temperature=0.0, use_cache=False)
    assert seen == [6, 7, 8]


def test_window_refill_prefills_only_the_last_tokens_past_the_window() -> None:
    model = tiny(max_seq_len=16)
    seen: list[int] = []
    model.tok_emb.register_forward_hook(lambda _module, args, _out: seen.append(args[0].size(1)))
    ids = prompt(1, 6)
    out = model.generate(ids, 30, temperature=0.0, window_refill=8)
    # Prefill 6, single steps up to 16 cached, then refill 8 and 8 more single steps, and so on.
    assert seen == [6] + [1] * 10 + ([8] + [1] * 8) * 2 + [8]
    # Within the window nothing changes; past it, each token is what a full forward over exactly the
    # context it saw gives.
    exact = model.generate(ids, 30, temperature=0.0)
    assert torch.equal(out[:, :17], exact[:, :17])
    # Token 17 (step 12) came from a refill of tokens 9..16; token 18 from the cache plus token 17.
    assert int(model(out[:, 9:17])["logits"][:, -1].argmax()) == int(out[0, 17])
    assert int(model(out[:, 9:18])["logits"][:, -1].argmax()) == int(out[0, 18])
    with pytest.raises(ValueError, match="window_refill"):
        model.generate(ids, 2, window_refill=17)


def test_a_model_without_a_cache_falls_back_to_full_context() -> None:
    class Bigram(nn.Module):
        """A plugin-style model: forward(x) -> logits, no forward_cached, no generate."""

        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(V, V)
            self.lengths: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lengths.append(x.size(1))
            return self.table(x)

    torch.manual_seed(0)
    model = Bigram()
    assert not supports_kv_cache(model) and supports_kv_cache(tiny())
    ids = prompt(1, 3)
    out = generate_tokens(model, ids, SamplingSettings(6, temperature=0.0), max_seq_len=4)
    assert model.lengths == [3, 4, 4, 4, 4, 4]  # the whole (cropped) context every step
    expected = ids
    for _ in range(6):
        expected = torch.cat([expected, model.table(expected[:, -1:])[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, expected)


def test_a_model_with_its_own_generate_keeps_it_unless_top_p_or_a_penalty_is_asked() -> None:
    class OwnGenerate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(V, V)
            self.generate_calls = 0

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.table(input_ids)

        def generate(self, ids, max_new_tokens, temperature=1.0, top_k=None, generator=None):  # type: ignore[no-untyped-def]
            self.generate_calls += 1
            for _ in range(max_new_tokens):
                ids = torch.cat([ids, next_token(self(ids)[:, -1], temperature, top_k, generator)], 1)
            return ids

    model = OwnGenerate()
    ids = prompt(1, 2)
    plain = generate_tokens(model, ids, SamplingSettings(5, temperature=0.0), max_seq_len=8)
    assert model.generate_calls == 1
    greedy_penalised = SamplingSettings(5, temperature=0.0, repetition_penalty=2.0)
    penalised = generate_tokens(model, ids, greedy_penalised, max_seq_len=8)
    assert model.generate_calls == 1 and penalised.shape == plain.shape  # the shared loop took it


# ----------------------------------------------------------------------------------- the sampling rule


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    drawn = {
        int(next_token(logits, 1.0, generator=torch.Generator().manual_seed(s), top_p=0.75))
        for s in range(200)
    }
    assert drawn == {0, 1}  # 0.5 + 0.3 reaches 0.75; tokens 2 and 3 are never drawn
    only_top = {
        int(next_token(logits, 1.0, generator=torch.Generator().manual_seed(s), top_p=0.4)) for s in range(50)
    }
    assert only_top == {0}  # the most likely token always survives
    # top_p 1 (and None) is plain sampling: the same draws for the same seed.
    for top_p in (None, 1.0):
        a = [
            int(next_token(logits, 0.7, 3, torch.Generator().manual_seed(s), top_p=top_p)) for s in range(20)
        ]
        b = [int(next_token(logits, 0.7, 3, torch.Generator().manual_seed(s))) for s in range(20)]
        assert a == b


def test_repetition_penalty_acts_on_seen_tokens_also_when_greedy() -> None:
    logits = torch.tensor([[3.0, 2.0, -1.0, -0.5]])
    seen = torch.tensor([[0, 0, 2]])
    assert int(next_token(logits, 0.0)) == 0
    assert int(next_token(logits, 0.0, repetition_penalty=2.0, history=seen)) == 1  # 3/2 < 2
    assert int(next_token(logits, 0.0, repetition_penalty=1.2, history=seen)) == 0  # 3/1.2 > 2
    # A negative logit is multiplied (more negative), not divided (which would favour it).
    down = torch.tensor([[-1.0, -1.5]])
    assert int(next_token(down, 0.0, repetition_penalty=2.0, history=torch.tensor([[0]]))) == 1
    assert torch.equal(logits, torch.tensor([[3.0, 2.0, -1.0, -0.5]]))  # the caller's logits untouched


def test_a_penalty_breaks_a_greedy_loop() -> None:
    model = tiny(seed=3, max_seq_len=64)
    ids = prompt(1, 4)
    looped = model.generate(ids, 60, temperature=0.0)[0, 4:].tolist()
    penalised = model.generate(ids, 60, temperature=0.0, repetition_penalty=1.5)[0, 4:].tolist()
    assert len(set(penalised)) > len(set(looped))


def test_a_repetition_window_penalises_only_the_last_tokens() -> None:
    model = tiny(seed=2, max_seq_len=32)
    ids = prompt(1, 5)
    windowed = model.generate(ids, 40, temperature=0.0, repetition_penalty=3.0, repetition_window=4)
    expected = ids  # the same rule by hand: full-context logits, history = the last 4 tokens
    for _ in range(40):
        logits = model(expected[:, -32:])["logits"][:, -1]
        expected = torch.cat(
            [expected, next_token(logits, 0.0, repetition_penalty=3.0, history=expected[:, -4:])], 1
        )
    assert torch.equal(windowed, expected)
    with pytest.raises(ValueError, match="repetition_window"):
        model.generate(ids, 2, repetition_penalty=2.0, repetition_window=0)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_settings_out_of_range_are_refused(bad: dict, match: str) -> None:
    settings = {"temperature": 1.0, **bad}
    if "seed" not in bad:  # generate takes a generator, not a seed
        with pytest.raises(ValueError, match=match):
            tiny().generate(prompt(1, 2), 2, **settings)
    with pytest.raises(ValueError, match=match):
        SamplingSettings(2, **settings)  # what stream_tokens and run_sampling take


# ----------------------------------------------------------------------------------------- streaming


def test_text_stream_holds_back_a_split_character() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("añb€c")  # ñ is 2 bytes, € 3
    stream = TextStream(tokenizer.decode)
    pieces = [stream.push(token) for token in ids]
    assert pieces == ["a", "", "ñ", "b", "", "", "€", "c"]
    assert stream.finish() == ""
    cut = TextStream(tokenizer.decode)
    assert [cut.push(token) for token in ids[:2]] == ["a", ""]
    assert cut.finish() == "\ufffd"  # an incomplete character at the end is printed as the text has it


def test_run_sampling_streams_pieces_that_add_up_to_the_text() -> None:
    model = tiny(max_seq_len=32)
    pieces: list[str] = []
    sampled = run_sampling(
        model,
        lambda ids: "".join(chr(65 + i % 26) for i in ids),
        [1, 2, 3],
        SamplingSettings(12, temperature=1.0, seed=4),
        max_seq_len=32,
        on_text=pieces.append,
    )
    assert len(pieces) == 12 and "".join(pieces) == sampled.text and len(sampled.token_ids) == 12
    assert sampled.kv_cache and sampled.tokens_per_s and sampled.tokens_per_s > 0
    assert 0 <= sampled.time_to_first_token_s <= sampled.generation_s
    again = run_sampling(model, str, [1, 2, 3], SamplingSettings(12, temperature=1.0, seed=4), max_seq_len=32)
    assert again.token_ids == sampled.token_ids
    # An end-of-sequence id stops it and is not kept.
    stopped = run_sampling(
        model,
        str,
        [1, 2, 3],
        SamplingSettings(12, temperature=1.0, seed=4),
        max_seq_len=32,
        eos_ids=[sampled.token_ids[2]],
    )
    assert stopped.token_ids == sampled.token_ids[: sampled.token_ids.index(sampled.token_ids[2])]


# ----------------------------------------------------------------------------------- through the CLI

CONFIG = """
run: {name: tiny, max_steps: 40, log_every: 20, eval_every: 40}
model: {n_layer: 2, n_head: 2, d_model: 32}
data: {block_size: 32, micro_batch_size: 8, val_batches: 1}
optimizer: {lr: 1.0e-2}
scheduler: {name: cosine, warmup_steps: 4}
checkpoint: {every_steps: 40}
"""


def cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("HF_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny byte-level transformer trained for 40 steps on the built-in text; its checkpoint directory."""
    root = tmp_path_factory.mktemp("sampling")
    (root / "tiny.yaml").write_text(CONFIG)
    result = cli("train", "tiny.yaml", "--json", "--set", "compile.enabled=false", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "runs" / "tiny" / "checkpoints"


def test_sample_json_reports_speed_and_honours_top_p_and_the_penalty(trained: Path) -> None:
    root = trained.parents[2]
    args = (
        "sample",
        trained,
        "--prompt",
        "ROMEO:",
        "-n",
        "40",
        "--top-p",
        "0.9",
        "--repetition-penalty",
        "1.3",
    )
    report = last_json(cli(*args, "--json", cwd=root).stdout)
    assert report["new_tokens"] == 40 and report["kv_cache"] is True
    assert report["tokens_per_s"] > 0 and 0 <= report["time_to_first_token_s"] <= report["generation_s"]
    assert report["prompt"] == "ROMEO:" and len(report["text"].encode("utf-8", "replace")) >= 1
    # Text mode streams the same continuation (same seed): prompt + text + newline, nothing else.
    streamed = cli(*args, cwd=root)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == "ROMEO:" + report["text"] + "\n"
    # Other settings, other text; the penalty changes the greedy text of this barely trained model.
    greedy = last_json(
        cli("sample", trained, "-p", "ROMEO:", "-n", "40", "-t", "0", "--json", cwd=root).stdout
    )
    penalised = last_json(
        cli(
            "sample",
            trained,
            "-p",
            "ROMEO:",
            "-n",
            "40",
            "-t",
            "0",
            "--repetition-penalty",
            "1.5",
            "--json",
            cwd=root,
        ).stdout
    )
    assert greedy["text"] != penalised["text"]
    windowed = cli(
        *("sample", trained, "-p", "ROMEO:", "-n", "40", "-t", "0", "--repetition-penalty", "1.5"),
        *("--repetition-window", "8", "--json"),
        cwd=root,
    )
    assert windowed.returncode == 0, windowed.stderr
    assert last_json(windowed.stdout)["new_tokens"] == 40
    # --window-refill past the 32-token window: still 80 tokens; beyond the window's size it is refused.
    refill = last_json(cli("sample", trained, "-n", "80", "--window-refill", "16", "--json", cwd=root).stdout)
    assert refill["new_tokens"] == 80
    too_big = cli("sample", trained, "-n", "2", "--window-refill", "33", cwd=root)
    assert too_big.returncode == 2 and "context window (1..32)" in too_big.stderr


def test_sample_greedy_through_the_cli_equals_full_context_greedy(trained: Path) -> None:
    root = trained.parents[2]
    report = last_json(
        cli("sample", trained, "-p", "ROMEO:", "-n", "50", "-t", "0", "--json", cwd=root).stdout
    )
    run = load_run(trained)
    ids = torch.tensor([run.tokenizer.encode("ROMEO:")])
    full = run.model.generate(ids, 50, temperature=0.0, use_cache=False)  # the pre-cache loop
    assert report["text"] == run.tokenizer.decode(full[0, ids.size(1) :].tolist())


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--top-p", "0"),
        ("--top-p", "1.5"),
        ("--repetition-penalty", "0"),
        ("--temperature", "-1"),
        ("--seed", "1180591620717411303424"),  # past 64 bits: was a traceback from torch
        ("--seed", "-9223372036854775809"),
    ],
)
def test_sample_refuses_settings_out_of_range(trained: Path, flag: str, value: str) -> None:
    result = cli("sample", trained, flag, value, "-n", "2", cwd=trained.parents[2])
    assert result.returncode == 2 and flag in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_sample_an_exported_folder_with_top_p_and_penalty_from_its_generation_config(trained: Path) -> None:
    root = trained.parents[2]
    assert cli("export", trained, "hf", cwd=root).returncode == 0
    gen_path = root / "hf" / "generation_config.json"
    generation = json.loads(gen_path.read_text())
    generation.update(do_sample=False, top_p=0.9, repetition_penalty=1.4, max_new_tokens=30)
    gen_path.write_text(json.dumps(generation))
    folder = last_json(cli("sample", "hf", "-p", "ROMEO:", "--json", cwd=root).stdout)
    used = folder["generation"]
    assert used["repetition_penalty"] == 1.4 and used["top_p"] == 0.9 and used["ignored"] == []
    assert folder["new_tokens"] == used["tokens"] == 30 and folder["kv_cache"] is True
    same = last_json(
        cli(
            "sample",
            trained,
            "-p",
            "ROMEO:",
            "-n",
            "30",
            "-t",
            "0",
            "--repetition-penalty",
            "1.4",
            "--json",
            cwd=root,
        ).stdout
    )
    assert folder["text"] == same["text"]  # the folder's model decodes like the checkpoint's
    assert cli("sample", "hf", "-p", "ROMEO:", "--top-p", "1", "--json", cwd=root).returncode == 0
