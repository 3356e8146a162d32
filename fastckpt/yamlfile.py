"""Reading YAML that a user or an attacker wrote: bounded in size, UTF-8, and no alias expands past a small bound.

A fastckpt config is a few dozen values, but the YAML it is read from may be anything: a 100 MB file (pure-Python
PyYAML parses about 2 MB a second), a FIFO or ``/dev/zero`` (read forever), binary junk, or a "billion laughs"
whose nested anchors parse in microseconds into a shared graph that every later copy (``dict(...)``,
``dataclasses.asdict``, ``json.dumps``) expands to 9^9 leaves. Each is refused here with a ``ConfigError`` naming
the source, before anything expands it.
"""
from __future__ import annotations

import os
import stat
from typing import Any

from .errors import ConfigError

__all__ = ["MAX_YAML_BYTES", "MAX_YAML_NODES", "MAX_YAML_DEPTH", "read_yaml", "load_yaml"]

MAX_YAML_BYTES = 1 << 20
"""The largest YAML source read (1 MiB): a config is a few KiB; this parses in well under a second."""
MAX_YAML_NODES = 10_000
"""The most values a document may hold once every alias is expanded (a config holds a few dozen)."""
MAX_YAML_DEPTH = 64
"""The deepest nesting of mappings and lists accepted (a config nests three levels)."""


def read_yaml(path: str | os.PathLike[str]) -> Any:
    """The data of the YAML file ``path`` (``None`` when empty); a ``ConfigError`` naming it when it is not a
    regular file, larger than ``MAX_YAML_BYTES``, not UTF-8, not YAML, or expands past ``MAX_YAML_NODES``."""
    name = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO with no writer must not block; its type is checked before any read.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot read fastckpt config {name!r}: {e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"fastckpt config {name!r} is not a regular file ({_kind(st.st_mode)}); "
                              "pass the path of a YAML file")
        if st.st_size > MAX_YAML_BYTES:
            raise ConfigError(f"fastckpt config {name!r} is {st.st_size} bytes, more than the {MAX_YAML_BYTES} a "
                              "config may have; is it the right file?")
        data = _read_at_most(fd, MAX_YAML_BYTES + 1)  # the file may grow after fstat: bounded all the same
    except OSError as e:
        raise ConfigError(f"cannot read fastckpt config {name!r}: {e}") from e
    finally:
        os.close(fd)
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"fastckpt config {name!r} grew past {MAX_YAML_BYTES} bytes while it was read")
    try:
        text = data.decode("utf-8-sig")  # an editor's byte order mark is fine
    except UnicodeDecodeError as e:
        raise ConfigError(f"fastckpt config {name!r} is not UTF-8 text (byte {e.start} is {data[e.start]:#04x}): "
                          "a fastckpt config is a YAML file") from e
    return load_yaml(text, repr(name))


def load_yaml(text: str, what: str) -> Any:
    """The data of one YAML document ``text`` (safe types only), refused with a ``ConfigError`` that names
    ``what`` when it is larger than ``MAX_YAML_BYTES``, invalid, nested deeper than ``MAX_YAML_DEPTH``, recursive,
    or holds more than ``MAX_YAML_NODES`` values once its aliases are expanded."""
    import yaml

    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(f"{what} holds {len(text)} characters of YAML, more than the {MAX_YAML_BYTES} accepted")
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # checks every character: NULs and other binary are a YAMLError here
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, what)  # on the composed graph: an alias is still one shared node here
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {e}") from e
    except RecursionError as e:  # the composer recurses per level; a ConfigError, not a crash
        raise ConfigError(f"{what} nests deeper than the {MAX_YAML_DEPTH} levels a config may have") from e
    finally:
        if loader is not None:
            loader.dispose()


def _check_expansion(root: Any, what: str) -> None:
    """Count the values ``root`` holds with every alias expanded, each shared node counted once per use but
    computed once (memoized), so a billion laughs is refused after a few dozen steps."""
    import yaml

    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(f"{what}: a YAML alias refers to a node that contains it (a recursive structure); "
                              "a config never needs one")
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{what} nests deeper than the {MAX_YAML_DEPTH} levels a config may have")
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        active.add(key)
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_YAML_NODES:
                raise ConfigError(f"{what} expands to more than {MAX_YAML_NODES} values (nested YAML aliases: "
                                  "anchors '&' reused through '*'); a fastckpt config holds a few dozen. Write the "
                                  "values out instead of aliasing them")
        active.discard(key)
        sizes[key] = total
        return total

    size(root, 0)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < limit:
        chunk = os.read(fd, min(1 << 16, limit - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a plain file"

