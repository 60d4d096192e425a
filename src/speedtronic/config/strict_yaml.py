"""One bounded, strict YAML reader for every config path: regular files only, a size limit, no
duplicate keys.

Why strict: PyYAML's safe loader silently keeps the last of two equal keys, so a config with two
`optimizer:` sections (or two `lr:` lines) trains with whichever came last and nobody notices. Why
bounded: a config path may name anything (`/dev/zero`, a FIFO, a 10 GB file); reading it must end at
once with an error naming the file, never grow without limit or block. Never imports torch.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import yaml

from speedtronic.errors import ConfigError
from speedtronic.secrets import scrub


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping names the same key twice (carries the line of the second one)."""


class StrictSafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate keys in any mapping (merge keys `<<` still work)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            # Keys written in this mapping (a `<<: *alias` merge may be overridden by them: that is
            # what merges are for); the merge itself is expanded by the base class.
            written = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]
            seen: dict[Any, Any] = {}
            for key_node in written:
                key = self.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys with its own message
                if key in seen:
                    raise DuplicateKey(
                        None,
                        None,
                        f"duplicate key {key!r} (first at line {seen[key].line + 1}); keep one",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, origin: str) -> Any:
    """Parse YAML text strictly; errors name `origin`, the line and column, and the problem."""
    try:
        return yaml.load(text, Loader=StrictSafeLoader)  # a SafeLoader subclass: never constructs objects
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark is not None else origin
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        kind = "" if isinstance(error, DuplicateKey) else "YAML syntax error: "
        raise ConfigError(scrub(f"{where}: {kind}{problem}")) from None
    except (Exception, RecursionError) as error:  # PyYAML raises plain errors for bad tags (!!int abc)
        raise ConfigError(
            scrub(f"{origin}: cannot parse YAML ({type(error).__name__}: {error})"[:300])
        ) from None


def read_text_file(path: str | Path, max_bytes: int, what: str = "config file") -> str:
    """The text of a regular file of at most `max_bytes` bytes (UTF-8). Special files (a FIFO, a
    device such as /dev/zero, a directory) are refused without reading them, and a FIFO never blocks
    the open. FileNotFoundError propagates for the caller's own message."""
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory; name a YAML file") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"{what} {path} is a directory; name a YAML file")
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(
                f"{what} {path} is not a regular file (a device, FIFO or socket); name a YAML file"
            )
        if info.st_size > max_bytes:
            raise ConfigError(
                f"{what} {path} is {info.st_size:,} bytes; a run config is at most {max_bytes:,}"
            )
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:  # the size may grow while we read: bound the read itself
            chunk = os.read(fd, min(1 << 16, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise ConfigError(f"{what} {path} is over {max_bytes:,} bytes; a run config is far smaller")
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"cannot read {what} {path}: it is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
