"""Hub datasets as ``data prepare`` input: ``hf://datasets/OWNER/NAME[@REVISION][/PATH]``.

The dataset repo is read at one commit (the revision, ``main`` by default, resolved to its sha once, so a
push during a long prepare never mixes two versions). Its data files under PATH (a folder, searched
recursively, or one file) are taken in the order a local ``data prepare`` of the same folder takes them
(files before sub-folders, each sorted; hidden names skipped), so the tokens equal those of preparing
the downloaded files locally. Kinds are the local ones: ``.parquet``, ``.jsonl``/``.json`` and ``.txt``,
optionally ``.gz``/``.zst``; in a folder, the dataset card (``.md``) and the ``datasets`` library's
metadata (``dataset_info.json``, ``state.json``, ...) are not data and are left out.

Streamed: a file is downloaded when its first work unit is needed, the next one in the background
while this one is tokenised (with ``max_tokens``, only when needed), and nothing more once the cap
is reached. Downloads go through
:class:`speedtronic.hub_client.HubClient` (timeouts, retries, token-free errors) with
``hf_hub_download`` at the commit's sha into the Hugging Face cache (``HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``; ``cache_dir`` to choose), where they stay: ``hf cache rm`` frees them.
Memory stays bounded by the local readers (Parquet one row group at a time, JSONL line by line).

Resumable: the run is the local prepare's (``prepare.run_prepare``), whose state lives in
``OUT/.prepare-partial/``, saved at least whenever a file is done; this module adds ``hub-files.json``
there, the work units of every file planned so far, so a resumed run skips finished files without
touching the network and finds an interrupted file's rest in the cache (a download cut short resumes
where it stopped).

A wrong name, revision, path or ``--text-field`` is a one-line ConfigError (exit 2); a Hub that stays
unreachable after retries is a BusError (exit 1) that keeps the partial run for a later resume.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from speedtronic.errors import BusError, ConfigError, DataPathError, PermissionDenied, TransientBusError

from .inputs import DEFAULT_UNIT_BYTES, InputFile, Unit, _kind_of, import_pyarrow_parquet, plan_units
from .prepare import _CHECKPOINT_UNITS, DEFAULT_SHARD_TOKENS, Progress, make_job, run_prepare, unit_weights
from .text import DEFAULT_CHUNK_BYTES
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from speedtronic.hub_client import HubClient

__all__ = [
    "HUB_SCHEME",
    "HubDataset",
    "RemoteFile",
    "hub_dataset_dir",
    "is_hub_dataset",
    "parse_hub_uri",
    "prepare_hub_dataset",
]

HUB_SCHEME = "hf://"
_PREFIX = "hf://datasets/"
_NOTES = "hub-files.json"
_FORM = "hf://datasets/OWNER/NAME[@REVISION][/PATH]"
_METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"})


def is_hub_dataset(spec: object) -> bool:
    """Whether an input or ``data.sources`` entry names a Hub dataset (``hf://...``) rather than a path."""
    return isinstance(spec, str) and spec.startswith(HUB_SCHEME)


@dataclass(frozen=True)
class HubDataset:
    """A parsed ``hf://datasets/...`` URI: the repo, a revision (None: main) and a path inside it."""

    repo_id: str
    revision: str | None
    path: str

    @property
    def uri(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{_PREFIX}{self.repo_id}{rev}" + (f"/{self.path}" if self.path else "")


def parse_hub_uri(uri: str) -> HubDataset:
    """``hf://datasets/OWNER/NAME[@REVISION][/PATH]`` → :class:`HubDataset`; ConfigError otherwise."""
    if not uri.startswith(_PREFIX):
        raise ConfigError(f"{uri}: only dataset repos can be prepared; write {_FORM}")
    parts = [p for p in uri[len(_PREFIX) :].split("/") if p]
    if len(parts) < 2:
        raise ConfigError(f"{uri}: name the owner and the dataset, as in {_FORM}")
    name, _, revision = parts[1].partition("@")
    path = "/".join(parts[2:])
    if not name or any(p in (".", "..") for p in parts) or (revision == "" and "@" in parts[1]):
        raise ConfigError(f"{uri}: not a dataset address; write {_FORM}")
    return HubDataset(f"{parts[0]}/{name}", unquote(revision) or None, path)


@dataclass(frozen=True)
class RemoteFile:
    """A data file of the repo at the pinned commit."""

    path: str
    size: int
    oid: str
    kind: str
    compression: str | None


def _is_metadata(name: str) -> bool:
    """A dataset card (README.md, any .md) or the `datasets` library's metadata files: not data."""
    return name.lower().endswith(".md") or name in _METADATA


def _walk_key(path: str) -> list[tuple[int, str]]:
    """The order of a local folder walk (``inputs._walk``): at each level files first, then folders,
    each sorted by name."""
    parts = path.split("/")
    return [(1, p) for p in parts[:-1]] + [(0, parts[-1])]


def _data_files(entries: list[Any], base: str, explicit: bool) -> list[RemoteFile]:
    found = []
    for entry in entries:
        path = getattr(entry, "path", "")
        size = getattr(entry, "size", None)
        if size is None or not path:  # a folder
            continue
        rel = path[len(base) :].lstrip("/") if base else path
        name = rel.rsplit("/", 1)[-1]
        if not explicit and (any(p.startswith(".") for p in rel.split("/")) or _is_metadata(name)):
            continue
        kind = _kind_of(PurePosixPath(path), explicit)
        if kind is not None:
            oid = getattr(entry, "blob_id", None) or ""
            found.append(RemoteFile(path, int(size), str(oid), kind[0], kind[1]))
    return sorted(found, key=lambda f: _walk_key(f.path))


def _pin(client: HubClient, ds: HubDataset) -> str:
    """The commit sha of the revision; ConfigError for a repo or revision that is not there."""
    from speedtronic.hub_client import NotFound

    what = f"{_PREFIX}{ds.repo_id}"
    try:
        info = client.call(
            f"{what}: read",
            lambda: client.api.repo_info(ds.repo_id, repo_type="dataset", revision=ds.revision),
        )
    except PermissionDenied:
        raise DataPathError(
            f"{what}: no such dataset on {client.endpoint}, or it is private or gated and your token "
            "cannot read it; check OWNER/NAME (and log in with `hf auth login` or set HF_TOKEN)",
            "input",
        ) from None
    except NotFound:
        raise DataPathError(
            f"{ds.uri}: revision {ds.revision!r} not found; give a branch, tag or commit of the dataset",
            "input",
        ) from None
    except TransientBusError as exc:
        raise BusError(f"{exc}; check the network, or HF_ENDPOINT if you meant another Hub") from None
    return str(info.sha)


def list_files(client: HubClient, ds: HubDataset) -> tuple[str, list[RemoteFile]]:
    """The pinned commit and the data files of ``ds`` there (see the module docstring)."""
    from speedtronic.hub_client import NotFound

    sha = _pin(client, ds)
    try:
        entries = client.call(
            f"{ds.uri}: list files",
            lambda: list(
                client.api.list_repo_tree(
                    ds.repo_id, ds.path or None, recursive=True, revision=sha, repo_type="dataset"
                )
            ),
        )
        explicit = False
    except (NotFound, BusError) as exc:  # PATH may name one file rather than a folder
        if isinstance(exc, (TransientBusError, PermissionDenied)):
            raise
        entries = [e for e in _parent_listing(client, ds, sha) if getattr(e, "path", "") == ds.path]
        explicit = True
        if not entries:
            raise DataPathError(
                f"{ds.uri}: no file or folder {ds.path!r} in {ds.repo_id}; see its file list on the Hub",
                "input",
            ) from None
    files = _data_files(entries, ds.path, explicit)
    if not files:
        raise DataPathError(
            f"{ds.uri} holds no .parquet, .jsonl, .json or .txt files (optionally .gz/.zst); "
            "point at a folder or file of the dataset that does",
            "input",
        )
    return sha, files


def _parent_listing(client: HubClient, ds: HubDataset, sha: str) -> list[Any]:
    from speedtronic.hub_client import NotFound

    parent = ds.path.rpartition("/")[0] or None
    try:
        return client.call(
            f"{ds.uri}: list files",
            lambda: list(client.api.list_repo_tree(ds.repo_id, parent, revision=sha, repo_type="dataset")),
        )
    except NotFound:
        return []


def check_text_field(file: InputFile, text_field: str, name: str) -> None:
    """ConfigError listing the columns when a Parquet file has no column ``text_field``, or the first
    record of a JSONL file no such field (bad records later on are the readers' business)."""
    columns: list[str] | None = None
    if file.kind == "parquet":
        pq = import_pyarrow_parquet(file.path)
        try:
            columns = list(pq.ParquetFile(file.path).schema_arrow.names)
        except Exception:  # not readable: the reader says so, naming the row group
            return
    elif file.kind == "jsonl" and not file.compression and not file.path.endswith(".json"):
        with open(file.path, "rb") as f:
            first = next((line for line in itertools.islice(f, 1000) if line.strip()), b"")
        try:
            record = json.loads(first)
        except ValueError:
            return
        columns = [str(k) for k in record] if isinstance(record, dict) else None
    if columns is not None and text_field not in columns:
        kind = "column" if file.kind == "parquet" else "field"
        shown = ", ".join(columns[:20]) + (", …" if len(columns) > 20 else "")
        raise ConfigError(
            f"--text-field {text_field!r}: {name} has no such {kind} (its {kind}s: {shown}); "
            f"pass --text-field with one of them"
        )


def _takes(function: Callable[..., object], name: str) -> bool:
    return name in inspect.signature(function).parameters


def _counting_bar(count: Callable[[int], None]) -> type[Any]:
    """A tqdm class for ``hf_hub_download`` that draws nothing and hands each update to ``count``."""
    from tqdm.auto import tqdm

    class Bar(tqdm):  # type: ignore[misc, type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            count(int(n or 0))
            return super().update(n)

    return Bar


class _Downloads:
    """Downloads the repo's files into the cache, the next one in the background; counts bytes."""

    def __init__(
        self,
        client: HubClient,
        ds: HubDataset,
        sha: str,
        files: list[RemoteFile],
        cache_dir: str | None,
        report: Callable[[int, int], None] | None,
        prefetch: bool,
    ) -> None:
        self.client, self.ds, self.sha, self.files, self.cache_dir = client, ds, sha, files, cache_dir
        self.prefetch = prefetch
        self.report = report
        self.total = sum(f.size for f in files)
        self.done = 0
        self.lock = threading.Lock()
        self.pending: dict[int, Future[str]] = {}

    def _count(self, n: int) -> None:
        with self.lock:
            self.done += n
            done = self.done
        if self.report is not None:
            self.report(min(done, self.total), self.total)

    def _download(self, index: int) -> str:
        f = self.files[index]
        counted = [0]

        def count(n: int) -> None:
            counted[0] += n
            self._count(n)

        api = self.client.api
        # Older huggingface_hub releases draw their own bar instead: the bytes then count when done.
        bar = {"tqdm_class": _counting_bar(count)} if _takes(api.hf_hub_download, "tqdm_class") else {}
        local = self.client.call(
            f"{self.ds.uri}: download {f.path}",
            lambda: api.hf_hub_download(
                self.ds.repo_id,
                f.path,
                repo_type="dataset",
                revision=self.sha,
                cache_dir=self.cache_dir,
                **bar,
            ),
        )
        self._count(max(0, f.size - counted[0]))  # a file found in the cache: nothing was counted
        return str(local)

    def get(self, index: int) -> str:
        """The local path of file ``index`` (downloading it now unless it is on its way), and the
        next file set downloading."""
        future = self.pending.pop(index, None)
        local = future.result() if future is not None else self._download(index)
        nxt = index + 1
        if self.prefetch and nxt < len(self.files) and nxt not in self.pending:
            self.pending[nxt] = self._in_background(nxt)
        return local

    def _in_background(self, index: int) -> Future[str]:
        future: Future[str] = Future()

        def run() -> None:
            try:
                future.set_result(self._download(index))
            except BaseException as exc:  # handed to whoever asks for the file
                future.set_exception(exc)

        # A daemon thread: a download cannot be stopped midway, and Ctrl-C must not wait for it (its
        # partial file stays in the cache, and the next download of that file resumes it).
        threading.Thread(target=run, name=f"hub-download-{index}", daemon=True).start()
        return future

    def close(self) -> None:
        self.pending.clear()  # a download still running finishes into the cache, unasked


def _read_notes(partial: Path) -> list[int]:
    try:
        counts = json.loads((partial / _NOTES).read_text(encoding="utf-8")).get("units", [])
    except (OSError, ValueError, AttributeError):
        return []
    ok = isinstance(counts, list) and all(isinstance(n, int) and n >= 0 for n in counts)
    return counts if ok else []


def _write_notes(partial: Path, counts: list[int]) -> None:
    tmp = partial / f".{_NOTES}.tmp"
    tmp.write_text(json.dumps({"units": counts}) + "\n", encoding="utf-8")
    os.replace(tmp, partial / _NOTES)


class _Feed:
    """The work units of the repo's files in order, from a global unit index (``prepare.UnitFeed``)."""

    def __init__(self, downloads: _Downloads, text_field: str, unit_bytes: int) -> None:
        self.downloads, self.text_field, self.unit_bytes = downloads, text_field, unit_bytes
        self.files_read = 0
        self.bytes_read = 0
        self.kinds: dict[str, int] = {}

    def _plan(self, index: int) -> list[Unit]:
        remote = self.downloads.files[index]
        local = self.downloads.get(index)
        st = os.stat(local)
        file = InputFile(local, remote.kind, remote.compression, st.st_size, st.st_mtime_ns)
        check_text_field(file, self.text_field, f"{_PREFIX}{self.downloads.ds.repo_id}/{remote.path}")
        self._read(remote)
        return plan_units([file], self.unit_bytes)

    def _read(self, remote: RemoteFile) -> None:
        self.files_read += 1
        self.bytes_read += remote.size
        kind = remote.kind + (f".{remote.compression}" if remote.compression else "")
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def source(self) -> dict[str, Any]:
        """``meta.json``'s ``source``: the repo, the commit and what was read of it."""
        downloads = self.downloads
        return {
            "name": downloads.ds.uri,
            "revision": downloads.sha,
            "bytes": self.bytes_read,
            "files": self.files_read,
            "files_listed": len(downloads.files),
            "kinds": self.kinds,
        }

    def __call__(self, start: int, partial: Path) -> Iterator[tuple[Unit, int]]:
        counts = _read_notes(partial)
        first, before = 0, 0  # global index of the file's first unit; input bytes before the file
        try:
            for index, remote in enumerate(self.downloads.files):
                if index < len(counts) and first + counts[index] <= start:  # finished: not downloaded
                    first, before = first + counts[index], before + remote.size
                    self._read(remote)
                    continue
                units = self._plan(index)
                if index == len(counts):
                    counts.append(len(units))
                    _write_notes(partial, counts)
                for j, done in enumerate(itertools.accumulate(unit_weights(units))):
                    if first + j >= start:
                        yield units[j], before + done
                first, before = first + len(units), before + remote.size
        finally:
            self.downloads.close()


def _fingerprint(ds: HubDataset, sha: str, files: list[RemoteFile], settings: dict[str, Any]) -> str:
    key = {
        "hub": [ds.repo_id, sha, ds.path],
        "inputs": [[f.path, f.size, f.oid] for f in files],
        **settings,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def prepare_hub_dataset(
    uri: str,
    out_dir: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    *,
    val_fraction: float = 0.1,
    text_field: str = "text",
    separator: str | None = None,
    dedup: bool = False,
    skip_bad: bool = False,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    max_tokens: int | None = None,
    unit_bytes: int = DEFAULT_UNIT_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    resume: bool = True,
    overwrite: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    progress: Progress | None = None,
    download_progress: Callable[[int, int], None] | None = None,
    client: HubClient | None = None,
    checkpoint_units: int = _CHECKPOINT_UNITS,
    stop_after_units: int | None = None,
) -> dict[str, Any]:
    """Prepare the Hub dataset ``uri`` (``hf://datasets/OWNER/NAME[@REV][/PATH]``) into ``out_dir``
    as :func:`~speedtronic.engine.data.prepare.prepare_dataset` prepares local files (same options,
    same tokens) and return the ``meta.json`` contents; ``meta["source"]`` names the repo, the commit
    and the files read. ``endpoint``/``token`` default to HF_ENDPOINT/HF_TOKEN (or the stored login),
    ``cache_dir`` to the Hugging Face cache. ``progress(done, total, tokens)`` follows tokenising
    (input bytes), ``download_progress(done, total)`` the downloads (bytes).

    This is the entry point for anything else that takes a Hub dataset (e.g. a ``data.sources``
    entry: ``if is_hub_dataset(spec): prepare_hub_dataset(spec, cache_folder, tokenizer)``).
    """
    from speedtronic.hub_client import HubClient

    job = make_job(
        tokenizer, val_fraction=val_fraction, chunk_bytes=chunk_bytes, text_field=text_field,
        separator=separator, dedup=dedup, skip_bad=skip_bad, workers=workers, shard_tokens=shard_tokens,
        unit_bytes=unit_bytes, max_tokens=max_tokens, checkpoint_units=checkpoint_units,
        stop_after_units=stop_after_units, checkpoint_file_ends=True,
    )  # fmt: skip
    ds = parse_hub_uri(uri)
    client = client or HubClient(endpoint=endpoint, token=token, retry_max=30.0, retry_attempts=6)
    sha, files = list_files(client, ds)
    # Under a cap the next file is fetched only when it is needed: the cap may fall in this one.
    downloads = _Downloads(client, ds, sha, files, cache_dir, download_progress, prefetch=max_tokens is None)
    feed = _Feed(downloads, text_field, unit_bytes)

    try:
        return run_prepare(
            job,
            out_dir,
            fingerprint=_fingerprint(ds, sha, files, job.settings()),
            feed=feed,
            total=sum(f.size for f in files),
            source=feed.source,
            what=ds.uri,
            progress=progress,
            resume=resume,
            overwrite=overwrite,
        )
    except BusError as exc:
        raise type(exc)(f"{exc}; the same command resumes where this one stopped") from None


def hub_dataset_dir(
    uri: str,
    root: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    *,
    text_field: str = "text",
    separator: str | None = None,
    val_fraction: float = 0.1,
    max_tokens: int | None = None,
    workers: int = 1,
) -> Path:
    """The prepared directory of the Hub dataset ``uri`` under ``root``, preparing it first unless a
    finished one is there (then no network is used): for a config entry that names a Hub dataset
    (``data.sources``). The folder name says which dataset and carries a digest of the options, so
    other options get a folder of their own; delete it to prepare again (say, after a new commit)."""
    ds = parse_hub_uri(uri)
    job = make_job(tokenizer, val_fraction=val_fraction, text_field=text_field, separator=separator,
                   max_tokens=max_tokens)  # fmt: skip
    digest = hashlib.sha256(json.dumps([ds.uri, job.settings()], sort_keys=True).encode()).hexdigest()[:12]
    name = "-".join(p for p in (ds.repo_id.replace("/", "--"), ds.revision, ds.path.replace("/", "--")) if p)
    out = Path(root) / f"{name}-{digest}"
    if not (out / "meta.json").is_file():
        prepare_hub_dataset(uri, out, job.tok, text_field=text_field, separator=separator,
                            val_fraction=val_fraction, max_tokens=max_tokens, workers=workers)  # fmt: skip
    return out
