"""`speedtronic export --format hf`: the folder transformers loads gives our logits, our tokenizer and
our sampling defaults; broken checkpoints are refused before anything is written; pushing fails cleanly.

Needs transformers (the dev extra installs it). Models are tiny: two layers, width 64.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_tokenizers import make_hf_tokenizer
from speedtronic.cli import main
from speedtronic.config import dump_config, load_config
from speedtronic.engine.build import build_model
from speedtronic.engine.checkpoint.files import save_checkpoint
from speedtronic.engine.data import ByteTokenizer
from speedtronic.errors import CheckpointError
from speedtronic.interop.hf_export import export_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("isolated_env", "restore_secrets")

SEQ = 48
TEXTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "  leading spaces, trailing spaces  \n\ttabs and\r\nwindows newlines",
    "héllo wörld — ünïcödé, 中文, emoji 🙂 and a NUL \x00 byte",
    "",
]


def make_checkpoint(directory: Path, *, tie: bool, n_kv_head: int | None, seed: int = 0) -> tuple[Path, Any]:
    """A checkpoint of a tiny reference transformer with non-trivial weights; returns (dir, model)."""
    config = load_config(
        {
            "model": {
                "n_layer": 2,
                "d_model": 64,
                "n_head": 4,
                "n_kv_head": n_kv_head,
                "tie_weights": tie,
                "rope_base": 500.0,
                "norm_eps": 1e-5,
            },
            "data": {"block_size": SEQ},
        }
    )
    torch.manual_seed(seed)
    model = build_model(config, 256)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Larger than the 0.02 init so attention patterns (and so RoPE) really shape the logits,
            # and norm gains away from 1 so a dropped or misplaced norm shows.
            param.mul_(1.0 + 0.5 * torch.randn_like(param)) if "norm" in name else param.mul_(5.0)
    save_checkpoint(
        directory,
        7,
        {
            "parts": {"model": model.state_dict(), "counters": {"step": 7, "tokens_seen": 99}},
            "config": dump_config(config),
        },
    )
    return directory, model.eval()


def call_main(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """The console-script entry point in-process (cheaper than a subprocess): (exit code, stdout, stderr)."""
    try:
        main([str(arg) for arg in argv])
        code: Any = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    ("tie", "n_kv_head"),
    [(True, None), (False, None), (True, 2), (False, 1)],
    ids=["tied-mha", "untied-mha", "tied-gqa", "untied-mqa"],
)
def test_from_pretrained_gives_our_logits(tmp_path: Path, tie: bool, n_kv_head: int | None) -> None:
    ckpt, model = make_checkpoint(tmp_path / "ckpt", tie=tie, n_kv_head=n_kv_head)
    result = export_hf(ckpt, tmp_path / "hf")
    assert result["architecture"] == "LlamaForCausalLM" and result["step"] == 7
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)["logits"]
    theirs = hf_logits(tmp_path / "hf", ids)
    assert ours.std() > 0.5  # the comparison is between real, varied logits
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| tie={tie} n_kv_head={n_kv_head}: {diff:.3g}")
    assert diff <= 1e-4

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is tie
    assert config["num_key_value_heads"] == (n_kv_head or 4)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert (
            "lm_head.weight" in set(f.keys())
        ) is not tie  # a tied head is stored once, like save_pretrained


def test_a_wrong_rope_base_would_be_caught(tmp_path: Path) -> None:
    """The logit comparison is sensitive to the RoPE mapping: change rope_theta and it fails by far."""
    ckpt, model = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=2)
    export_hf(ckpt, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = 10000.0
    path.write_text(json.dumps(config))
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(ids)["logits"]
    assert (ours - hf_logits(tmp_path / "hf", ids)).abs().max().item() > 1e-2


def test_the_byte_tokenizer_loads_with_autotokenizer_and_round_trips(tmp_path: Path) -> None:
    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=None)
    export_hf(ckpt, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = ByteTokenizer()
    assert len(tokenizer) == 256
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == ours.encode(text), text
        assert tokenizer.decode(ids) == text == ours.decode(ids)
    every_byte = list(range(256))
    assert tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(every_byte)) == every_byte
    broken = [0xE2, 0x82, 65]  # a truncated UTF-8 sequence decodes to U+FFFD, as ours does
    assert tokenizer.decode(broken) == ours.decode(broken)


@pytest.mark.parametrize("via", ["data.tokenizer", "data.dataset"])
def test_a_run_with_a_hf_tokenizer_exports_that_tokenizer(tmp_path: Path, via: str) -> None:
    from speedtronic.engine.data import HFTokenizer
    from speedtronic.engine.data.prepare import prepare_dataset

    make_hf_tokenizer(tmp_path / "tokenizer.json", TEXTS * 20, vocab_size=300, split_newlines=False)
    ours = HFTokenizer(tmp_path / "tokenizer.json")
    if via == "data.tokenizer":
        data = {"tokenizer": str(tmp_path / "tokenizer.json")}
    else:  # a prepared dataset remembers its tokenizer; the run config need not name it
        (tmp_path / "corpus.txt").write_text("\n".join(TEXTS * 50), encoding="utf-8")
        prepare_dataset(
            tmp_path / "corpus.txt", tmp_path / "dataset", tokenizer=str(tmp_path / "tokenizer.json")
        )
        data = {"dataset": str(tmp_path / "dataset")}
    config = load_config({"model": {"n_layer": 1, "d_model": 32, "n_head": 2}, "data": data})
    torch.manual_seed(0)
    model = build_model(config, ours.vocab_size)
    save_checkpoint(
        tmp_path / "ckpt", 1, {"parts": {"model": model.state_dict()}, "config": dump_config(config)}
    )
    export_hf(tmp_path / "ckpt", tmp_path / "hf")

    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["vocab_size"] == ours.vocab_size and hf_config["eos_token_id"] == ours.eos_id
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.eos_token == "<|endoftext|>"
    for text in TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == ours.encode(text), text


# ----------------------------------------------------------------------------------- refusals


def corrupt_checkpoint(tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    _, model = make_checkpoint(tmp_path / "good", tie=False, n_kv_head=2)
    state = dict(model.state_dict())
    edit(state)
    config = load_config(
        {
            "model": {"n_layer": 2, "d_model": 64, "n_head": 4, "n_kv_head": 2, "tie_weights": False},
            "data": {"block_size": SEQ},
        }
    )
    save_checkpoint(tmp_path / "bad", 3, {"parts": {"model": state}, "config": dump_config(config)})
    return tmp_path / "bad"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.pop("blocks.1.mlp.up_proj.weight"),
            r"tensor blocks\.1\.mlp\.up_proj\.weight \(shape \[192, 64\]\) is missing",
        ),
        (
            lambda s: s.update({"blocks.0.attn.k_proj.weight": torch.zeros(64, 64)}),
            r"tensor blocks\.0\.attn\.k_proj\.weight has shape \[64, 64\] but the stored config .*n_kv_head=2.* implies \[32, 64\]",
        ),
        (
            lambda s: s.update({"blocks.0.attn.bias": torch.zeros(64)}),
            r"tensor blocks\.0\.attn\.bias is not part of the model",
        ),
        (lambda s: s["norm.weight"].fill_(float("nan")), r"tensor norm\.weight holds NaN or inf"),
    ],
    ids=["missing", "mismatched", "extra", "nan"],
)
def test_a_broken_checkpoint_is_refused_naming_the_tensor(
    tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None], message: str
) -> None:
    bad = corrupt_checkpoint(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        export_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # checked before anything is written


def test_cli_refuses_a_mismatched_checkpoint_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = corrupt_checkpoint(
        tmp_path, lambda s: s.update({"blocks.0.attn.k_proj.weight": torch.zeros(64, 64)})
    )
    code, _, err = call_main(capsys, "export", bad, tmp_path / "out", "--format", "hf")
    assert code == 1, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "blocks.0.attn.k_proj.weight" in errors[0] and "[32, 64]" in errors[0]
    assert not (tmp_path / "out").exists()


def test_cli_export_json_and_refusing_a_non_empty_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=None)
    code, out, err = call_main(capsys, "export", ckpt, tmp_path / "hf", "--json")
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["files"] == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert summary["parameters"] == 2 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64) + 64 + 256 * 64
    code, _, err = call_main(capsys, "export", ckpt, tmp_path / "hf")
    assert code == 2 and "--overwrite" in err  # a usage mistake
    assert call_main(capsys, "export", ckpt, tmp_path / "hf", "--overwrite", "--dtype", "bfloat16")[0] == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    # Every file was renamed into place: no temp file is left behind, and each has the usual mode.
    assert not [p.name for p in (tmp_path / "hf").iterdir() if p.name.startswith(".")]
    modes = {(p.stat().st_mode & 0o777) for p in (tmp_path / "hf").iterdir()}
    assert len(modes) == 1, modes  # model.safetensors too (safetensors alone makes it owner-only)


def test_cli_export_onto_a_file_is_one_line_even_with_overwrite(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=None)
    target = tmp_path / "hf"
    target.write_text("not a folder")
    for flags in ([], ["--overwrite"]):
        code, _, err = call_main(capsys, "export", ckpt, target, *flags)
        assert code == 2 and "Traceback" not in err, err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "is a file, not a folder" in errors[0], err
        assert target.read_text() == "not a folder"


# -------------------------------------------------------------------------------------- pushing


HF_SECRET = "hf_" + "Zq7" * 12


def test_push_without_a_token_fails_before_writing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=None)
    code, _, err = call_main(capsys, "export", ckpt, tmp_path / "hf", "--push-to-hub", "someone/model")
    assert code == 1, err  # isolated_env: no HF_TOKEN and no stored login
    assert "no Hugging Face token" in err and "HF_TOKEN" in err
    assert "Traceback" not in err
    assert not (tmp_path / "hf").exists()


def test_push_to_an_unreachable_endpoint_is_one_line_without_the_token(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as sock:  # a loopback port that nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=None)
    endpoint = f"http://127.0.0.1:{port}"
    code, out, err = call_main(
        capsys, "export", ckpt, tmp_path / "hf", "--push-to-hub", "someone/model", "--endpoint", endpoint
    )
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and endpoint in errors[0] and "someone/model" in errors[0], err
    assert "Traceback" not in err
    assert HF_SECRET not in out + err
    assert (tmp_path / "hf" / "model.safetensors").exists()  # the export itself is kept


class FakeHub:
    """A loopback stand-in for the four Hub endpoints a small upload_folder uses: create the repo,
    validate the README's YAML, preupload (answering "regular" for every file, so no LFS), commit (NDJSON
    with base64 file contents). It records requests, Authorization headers and the committed files."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.auth: set[str] = set()
        self.files: dict[str, bytes] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.paths.append(self.path)
                hub.auth.add(self.headers.get("authorization", ""))
                if self.path == "/api/repos/create":
                    request = json.loads(body)
                    return self.reply(200, {"url": f"{hub.url}/{request['organization']}/{request['name']}"})
                if self.path == "/api/validate-yaml":
                    return self.reply(200, {"errors": [], "warnings": []})
                if "/preupload/" in self.path:
                    files = [
                        {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                        for f in json.loads(body)["files"]
                    ]
                    return self.reply(200, {"files": files})
                if "/commit/" in self.path:
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item.get("key") == "file":
                            hub.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    oid = "a" * 40
                    return self.reply(
                        200, {"commitUrl": f"{hub.url}/someone/model/commit/{oid}", "commitOid": oid}
                    )
                return self.reply(404, {"error": f"not emulated: {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub()
    yield hub
    hub.close()


def test_push_to_hub_uploads_every_file_with_the_token(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=2)
    code, out, err = call_main(
        capsys,
        "export",
        ckpt,
        tmp_path / "hf",
        "--push-to-hub",
        "someone/model",
        "--endpoint",
        fake_hub.url,
        "--json",
    )
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["url"] == f"{fake_hub.url}/someone/model"
    assert (
        fake_hub.paths[0] == "/api/repos/create"
        and fake_hub.paths[-1] == "/api/models/someone/model/commit/main"
    )
    local = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert fake_hub.files == local  # every file, byte for byte
    assert fake_hub.auth == {f"Bearer {HF_SECRET}"}
    assert HF_SECRET not in out + err


# ------------------------------------------------------------------------------------- sampling


def test_sample_an_exported_folder_honours_generation_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=False, n_kv_head=2)
    export_hf(ckpt, tmp_path / "hf")
    gen_path = tmp_path / "hf" / "generation_config.json"
    generation = json.loads(gen_path.read_text())
    assert generation["do_sample"] is True and generation["temperature"] == 0.8  # sample's defaults
    generation.update(do_sample=False, max_new_tokens=6)
    gen_path.write_text(json.dumps(generation))

    def sample(*args: object) -> dict[str, Any]:
        code, out, err = call_main(capsys, "sample", *args, "--prompt", "ROMEO:", "--json")
        assert code == 0, err
        return json.loads(out.strip().splitlines()[-1])

    folder = sample(tmp_path / "hf", "--seed", "1")
    assert folder["generation"]["temperature"] == 0.0 and folder["generation"]["tokens"] == 6
    assert sample(tmp_path / "hf", "--seed", "2")["text"] == folder["text"]  # greedy: seed-independent
    # The same greedy continuation as sampling the checkpoint itself.
    assert sample(ckpt, "--temperature", "0", "--max-new-tokens", "6")["text"] == folder["text"]

    # eos_token_id stops generation: make the first greedy token the eos.
    first = folder["generation"]["token_ids"][0]
    generation["eos_token_id"] = first
    gen_path.write_text(json.dumps(generation))
    stopped = sample(tmp_path / "hf")
    assert stopped["text"] == "" and stopped["generation"]["tokens"] == 0
    # Command-line settings win over the file.
    assert (
        sample(tmp_path / "hf", "--max-new-tokens", "3", "--temperature", "1.0")["generation"][
            "max_new_tokens"
        ]
        == 3
    )


def test_export_writes_files_atomically_with_normal_permissions(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import os
    import stat

    ckpt, _ = make_checkpoint(tmp_path / "ckpt", tie=True, n_kv_head=None)
    old_umask = os.umask(0o022)
    try:
        code, _, err = call_main(capsys, "export", ckpt, tmp_path / "hf")
    finally:
        os.umask(old_umask)
    assert code == 0, err
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        mode = stat.S_IMODE((tmp_path / "hf" / name).stat().st_mode)
        assert mode == 0o644, f"{name} is {oct(mode)}, not rw-r--r--"
    assert not [p.name for p in (tmp_path / "hf").iterdir() if p.name.startswith(".")]  # no temp files left
