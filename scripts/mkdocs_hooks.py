"""mkdocs hooks (mkdocs.yml `hooks:`): the reference pages rendered during every documentation build.

The source inventory (`reference/source.md`, scripts/gen_docs.py `BUILD_TIME`) is not committed; each
build renders it from the source and adds it to the site's files, replacing a local copy that
`python scripts/gen_docs.py inventory` may have written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

GENERATOR = Path(__file__).resolve().parent / "gen_docs.py"


def _gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("speedtronic_gen_docs", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: MkDocsConfig) -> Files:
    gen_docs = _gen_docs()
    for page in sorted(gen_docs.BUILD_TIME):
        name, render = gen_docs.PAGES[page]
        src_uri = f"reference/{name}"
        local = files.get_file_from_path(src_uri)
        if local is not None:
            files.remove(local)
        files.append(File.generated(config, src_uri, content=render()))
    return files
