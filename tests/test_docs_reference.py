"""The generated reference pages (docs/reference/) are fresh, complete and honest.

- Fresh: each committed page equals what `scripts/gen_docs.py` writes now, so a config field, CLI option
  or hook changed without regenerating fails here (the fix: `python scripts/gen_docs.py`).
- The source inventory is not committed (the documentation build renders it, scripts/mkdocs_hooks.py):
  the generator writes it into a temporary folder, and the page it wrote is checked.
- Complete: every config field has a description, every command, option and argument has help.
- Hooks: every `@hookspec` in hookspecs.py is on the hook page with its exact signature, and is *tested*:
  a test file (tests/ or plugins/*/tests/, not the docs tests) defines a function of that name, i.e. a
  test plugin implements it.
- The source inventory is built from `ast` alone: a subprocess renders it with torch imports made to
  fail and sockets refused, and checks torch was never imported.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "scripts" / "gen_docs.py"
DOCS_TESTS = {"test_docs_reference.py", "test_docs_blocks.py", "test_docs_site.py", "docs_blocks.py"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_docs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_docs = _load_generator()


@pytest.mark.parametrize("page", sorted(gen_docs.COMMITTED))
def test_generated_page_is_fresh(page: str) -> None:
    path = gen_docs.page_path(page)
    assert path.exists(), f"{path.relative_to(ROOT)} is missing; run: python scripts/gen_docs.py {page}"
    committed = path.read_text(encoding="utf-8")
    assert committed == gen_docs.PAGES[page][1](), (
        f"{path.relative_to(ROOT)} is stale (the code changed since it was generated); "
        f"run: python scripts/gen_docs.py {page}"
    )


def test_check_mode_reports_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gen_docs, "REFERENCE", tmp_path)
    assert gen_docs.main(["hooks", "--check"]) == 1  # missing counts as stale; nothing written
    assert not (tmp_path / "hooks.md").exists()
    assert gen_docs.main(["hooks"]) == 0 and (tmp_path / "hooks.md").exists()
    assert gen_docs.main(["hooks", "--check"]) == 0
    (tmp_path / "hooks.md").write_text("edited by hand\n")
    assert gen_docs.main(["hooks", "--check"]) == 1


def test_config_page_follows_a_new_field(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the freshness test relies on: the page is read from the live models.
    from pydantic import Field, create_model

    from speedtronic.config import schema

    extended = create_model(
        "RunConfig", __base__=schema.RunConfig, new_knob=(int, Field(3, gt=0, description="A new knob."))
    )
    monkeypatch.setitem(schema.SECTIONS, "run", extended)
    assert "| `run.new_knob` | int | `3` | > 0 | A new knob. |" in gen_docs.render_config()


def test_every_config_field_has_a_description() -> None:
    from speedtronic.config.schema import SECTIONS, Config

    missing = [
        name for name, field in Config.model_fields.items() if not field.description and name not in SECTIONS
    ]
    for section, model in SECTIONS.items():
        missing += [
            f"{section}.{name}" for name, field in model.model_fields.items() if not field.description
        ]
    assert missing == [], "config fields without a description (schema.py)"


def test_every_command_option_and_argument_has_help() -> None:
    gen_docs._import_src()
    import typer.main

    from speedtronic.cli.app import build_app

    missing: list[str] = []

    def walk(command, path: str) -> None:
        if not (command.help or "").strip():
            missing.append(path)
        missing.extend(
            f"{path} {param.opts[0] if param.opts else param.name}"
            for param in command.params
            if not getattr(param, "hidden", False) and not (getattr(param, "help", None) or "").strip()
        )
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(build_app(with_plugins=False)), "speedtronic")
    assert missing == [], "commands/options without help text"


def test_cli_page_does_not_depend_on_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    # The page is built without plugins; loading them must not leak in even when they are allowed.
    monkeypatch.delenv("SPEEDTRONIC_LOAD_PLUGINS", raising=False)
    page = gen_docs.render_cli()
    assert "speedtronic train" in page and "speedtronic checkpoint inspect" in page
    assert "hf-causal-lm" not in page and "example-gru" not in page


def test_every_hook_is_documented_with_its_exact_signature() -> None:
    from speedtronic import hookspecs

    page = gen_docs.page_path("hooks").read_text(encoding="utf-8")
    specs = gen_docs.hookspecs()
    assert {name for name, _, _ in specs} == set(hookspecs.HOOK_NAMES)
    for name, signature, _ in specs:
        assert f"## `{name}`" in page, f"hook {name} is not on docs/reference/hooks.md"
        assert signature in page, f"hook {name}: its signature {signature!r} is not on the page"
        assert signature.startswith(f"def {name}(")


def test_every_hook_is_tested() -> None:
    # "Tested" = some test implements the hook: a function of that name (a test plugin's hookimpl)
    # in a test file, so the hook is exercised through the plugin host, not just mentioned.
    implemented: dict[str, list[str]] = {}
    for pattern in ("tests/**/*.py", "plugins/*/tests/**/*.py"):
        for path in ROOT.glob(pattern):
            if path.name in DOCS_TESTS:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    implemented.setdefault(node.name, []).append(path.relative_to(ROOT).as_posix())
    untested = [name for name, _, _ in gen_docs.hookspecs() if name not in implemented]
    assert untested == [], f"hooks no test implements (write a test plugin with a hookimpl): {untested}"


def test_the_inventory_is_not_committed_but_built() -> None:
    assert gen_docs.COMMITTED and "inventory" not in gen_docs.COMMITTED
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", "docs/reference/source.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if tracked.returncode == 128 and "not a git repository" in tracked.stderr:
        pytest.skip("not a git checkout")
    assert tracked.returncode != 0, "docs/reference/source.md is tracked; it is rendered by the docs build"
    hooks = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "scripts/mkdocs_hooks.py" in hooks


def test_check_mode_renders_but_does_not_require_the_inventory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gen_docs, "REFERENCE", tmp_path)
    rendered: list[str] = []
    monkeypatch.setitem(gen_docs.PAGES, "inventory", ("source.md", lambda: rendered.append("x") or "x\n"))
    assert gen_docs.main(["inventory", "--check"]) == 0 and rendered == ["x"]
    assert not (tmp_path / "source.md").exists()


def test_inventory_reads_source_without_importing_torch_or_the_network(tmp_path: Path) -> None:
    probe = f"""
import builtins, socket, sys
real_import = builtins.__import__
def guarded(name, *args, **kwargs):
    if name == "torch" or name.startswith("torch."):
        raise ImportError("the source inventory must not import torch")
    return real_import(name, *args, **kwargs)
builtins.__import__ = guarded
def no_network(*args, **kwargs):
    raise OSError("the source inventory must not touch the network")
socket.socket = no_network
socket.create_connection = no_network
sys.argv = ["gen_docs.py", "inventory", "--out", {str(tmp_path)!r}]
import runpy
try:
    runpy.run_path({str(GENERATOR)!r}, run_name="__main__")
except SystemExit as exit_:
    assert not exit_.code, f"gen_docs.py inventory exited {{exit_.code}}"
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules), "torch was imported"
assert not any(m == "speedtronic" or m.startswith("speedtronic.") for m in sys.modules), "speedtronic was imported"
print("inventory ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0 and "inventory ok" in result.stdout, result.stderr
    page = (tmp_path / "source.md").read_text(encoding="utf-8")
    assert page == gen_docs.render_inventory()
    assert page.startswith("<!-- Generated by scripts/gen_docs.py (inventory)")
    assert "## `speedtronic`\n\n`src/speedtronic/__init__.py`" in page


def test_inventory_lists_every_module_and_top_level_definition(tmp_path: Path) -> None:
    assert gen_docs.main(["inventory", "--out", str(tmp_path)]) == 0
    page = (tmp_path / "source.md").read_text(encoding="utf-8")
    for module, path in gen_docs.source_files():
        assert f"## `{module}`" in page, module
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                assert f"`{node.name}" in page or f"def {node.name}(" in page, f"{module}.{node.name}"
