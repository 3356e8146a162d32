"""What every command shares: where the storage options come from, and how output is written.

Storage options may be given anywhere on the line, in three forms merged in this order (a later
one wins key by key): the ``storage_options`` of a fastckpt YAML (``--config``), a JSON object
(``--storage-options``, kept for scripts), and ``--storage-option key=value`` pairs whose values
are parsed as YAML (``anon=true`` is a bool, ``client_kwargs.endpoint_url=http://...`` nests).
Nothing here imports torch: ``fastckpt --help`` must stay fast.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import ConfigError

__all__ = ["CliOptions", "checkpoint_config", "parse_pair", "merge_pairs", "load_options", "is_remote", "print_json"]


@dataclass(frozen=True, slots=True)
class CliOptions:
    """The options every command reads, resolved once from the command line and ``--config``."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for every path on the line."""
    remote_url: str | None = None
    """The remote tier (``--remote`` or the YAML's ``remote.url``): ``list`` shows what lives where."""
    remote_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options of the remote tier (the YAML's ``remote.storage_options``, else ``storage_options``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The whole ``--config`` mapping (``persist-pending`` builds its Checkpointer from it)."""


def checkpoint_config(opts: CliOptions, root: str, **sections: Any) -> Any:
    """A ``CheckpointConfig`` for ``root``: the ``--config`` YAML's settings, this line's storage options, and
    ``sections`` merged over the YAML's (``staging={"shm": True}``)."""
    from .. import CheckpointConfig

    data = dict(opts.config)
    for name, values in sections.items():
        data[name] = {**(data.get(name) or {}), **values}
    data.update(root=root, storage_options=opts.storage_options)
    return CheckpointConfig.from_dict(data)


def parse_pair(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value parsed as YAML); the error names the pair and the fix."""
    from ..config import load_yaml  # bounded: an alias bomb on the command line is refused too

    key, sep, raw = text.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(f"--storage-option {text!r} must look like key=value (nested: client_kwargs.region_name=x)")
    try:
        value = load_yaml(raw, f"the value of --storage-option {key.strip()!r}") if raw.strip() else ""
    except ConfigError as e:
        raise ConfigError(f"{e}; quote it") from e
    return path, value


def merge_pairs(base: dict[str, Any], pairs: Iterable[str]) -> dict[str, Any]:
    """``base`` updated with each ``key=value`` pair (dotted keys build nested mappings)."""
    out = json.loads(json.dumps(base))  # a deep copy: the YAML's mapping stays as it was read
    for text in pairs:
        path, value = parse_pair(text)
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
    return out


def load_options(config: str | None, options_json: dict[str, Any] | None, pairs: Iterable[str],
                 remote: str | None) -> CliOptions:
    """Resolve the storage options of one command line; a bad YAML is a ``ConfigError`` naming it."""
    data: dict[str, Any] = {}
    if config is not None:
        from .. import CheckpointConfig
        from ..config import config_mapping

        data = config_mapping(config)
        CheckpointConfig.from_dict({"root": ".", **data})  # validated now: a typo fails before any work
    if options_json is not None and not isinstance(options_json, dict):
        raise ConfigError(f"--storage-options must be a JSON object, got {type(options_json).__name__}")
    storage = merge_pairs({**(data.get("storage_options") or {}), **(options_json or {})}, pairs)
    rem = data.get("remote") or {}
    url = remote if remote is not None else rem.get("url")
    return CliOptions(storage, url, dict(rem.get("storage_options") or storage), data)


def is_remote(path: str) -> bool:
    """Whether ``path`` is an fsspec URL of a remote store (``file://`` is local)."""
    return "://" in path and not path.startswith("file://")


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, sort_keys=False))
