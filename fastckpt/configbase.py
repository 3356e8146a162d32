"""The building blocks of the config sections: a section that checks every assignment, and the field checks.

``config.py`` (the storage, staging and retention sections, the whole config) and ``configtime.py`` (the sections
about when to checkpoint) build on them; users never import this module.
"""
from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from .errors import ConfigError

__all__ = ["Freezable", "check_choice", "check_int", "check_seconds"]


class Freezable:
    """A config section that checks every assignment and refuses changes once a ``Checkpointer`` holds it.

    Every field is checked when the object is built and again on every later assignment (``cfg.staging.slots = 0``
    raises ``ConfigError`` naming ``staging.slots`` and keeps the old value): a bad value never waits in a config
    until it hangs ``save()``. Once a Checkpointer holds the config it is frozen: the Checkpointer sized its threads,
    buffers and rules from it and reads some fields later again, so a change in between would leave it half on the
    old value and half on the new one. ``dataclasses.replace`` builds a new, unfrozen config for a new Checkpointer.
    """

    __slots__ = ("_frozen", "_ready", "_checking")
    _prefix = ""  # the field path of this section, for error messages

    def __post_init__(self) -> None:
        self._checked()
        object.__setattr__(self, "_ready", True)  # built: from now on every assignment is checked

    def validate(self) -> None:
        """Check (and normalize) every field, raising ``ConfigError`` naming the first bad one."""

    def _checked(self) -> None:
        # validate()'s own normalizing assignments (``root = str(root)``) go straight through while it runs
        object.__setattr__(self, "_checking", True)
        try:
            self.validate()
        finally:
            object.__setattr__(self, "_checking", False)

    def __setattr__(self, name: str, value: Any) -> None:
        known = self.__dataclass_fields__  # type: ignore[attr-defined]
        if name not in known:  # a typo (``staging.slot``) must not pass for a setting
            raise ConfigError(f"{self._prefix}{name} is not a config field; the fields of "
                              f"{self._prefix.rstrip('.') or 'the top level'} are {sorted(known)}")
        if getattr(self, "_frozen", False):
            raise ConfigError(f"{self._prefix}{name} cannot change: a Checkpointer uses this config (it is frozen "
                              "once a Checkpointer holds it). Build a new one with dataclasses.replace(config, ...) "
                              "and create a new Checkpointer")
        if not getattr(self, "_ready", False) or getattr(self, "_checking", False):
            object.__setattr__(self, name, value)  # being built or validated: checked as a whole right after
            return
        old = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self._checked()
        except BaseException:
            object.__setattr__(self, name, old)  # refused: the config stays as it was
            raise

    def freeze(self) -> None:
        """Called by ``Checkpointer.__init__``: check the whole config once more (a list or dict field may have
        changed in place), then refuse every later assignment, in the sections too."""
        if self.frozen:
            return
        self._checked()
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Freezable):
                value.freeze()
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        """Whether a ``Checkpointer`` holds this config (assignments then raise ``ConfigError``)."""
        return getattr(self, "_frozen", False)

    # A copy (copy, deepcopy, pickle: ddp_spawn sends the plugin's config) is a new config, not frozen.
    def __getstate__(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()  # checked like any new config


def check_int(section: str, name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or null" if allow_none else ""
        raise ConfigError(f"{section}{name} must be an integer >= {minimum}{none}, got {value!r}")


def check_choice(section: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}{name} must be one of {', '.join(allowed)}; got {value!r}")


def check_seconds(section: str, name: str, value: Any, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise ConfigError(f"{section}{name} must be a finite number of seconds >= {minimum}, got {value!r}")
