"""How the command writes text a person reads: control characters made visible, sizes in human units, tables aligned.

A checkpoint's file names, manifest fields, pickled strings and the messages of libraries all reach the
terminal; any of them may carry an ANSI escape (``\\x1b[2J`` clears the screen, ``\\x1b]8;;`` forges a
link) or a carriage return that overwrites what was printed. Everything the command prints goes
through ``clean`` first, so such bytes appear as visible ``\\x1b`` escapes, never as terminal commands.
Nothing here imports torch.
"""
from __future__ import annotations

import re
from typing import Sequence

__all__ = ["clean", "human_size", "shorten_key", "table"]

# C0 controls (tab and newline included: one cell, one message line), DEL and the C1 controls (0x9b is a
# one-byte CSI on some terminals).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean(text: object) -> str:
    """``str(text)`` with every control character written as a visible escape (``\\x1b``, ``\\r``)."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


def human_size(n: int | float) -> str:
    """``n`` bytes in decimal units, as ``ls -lh --si`` and the progress lines print them: ``812 B``, ``4.2 MB``."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"  # unreachable: the loop returns at TB


_BRACED = re.compile(r"\{[^{}]*\}")


def shorten_key(key: str, width: int) -> str:
    """A dotted (or slashed) key path cut to ``width`` characters for a table: first any ``{...}`` part collapsed
    (Lightning names a callback's state ``ModelCheckpoint{'monitor': None, 'mode': 'min', ...}``), then whole
    middle segments dropped for ``...`` (the first and the last stay: where the key is and what the value is),
    and only as a last resort its characters."""
    if len(key) <= width:
        return key
    key = _BRACED.sub("{...}", key)
    if len(key) <= width:
        return key
    # each segment keeps its separator; the dots of a collapsed "{...}" separate nothing
    parts = [p.replace("\0", "{...}") for p in re.split(r"(?<=[./])", key.replace("{...}", "\0"))]
    head, tail = parts[:1], parts[-1:]
    rest = parts[1:-1]
    while rest:  # add segments from both ends, the end first (the leaf names the value), while they fit
        for side in ("tail", "head"):
            if not rest:
                break
            piece = rest[-1] if side == "tail" else rest[0]
            if len("".join(head)) + 3 + len("".join(tail)) + len(piece) > width:
                rest = []
                break
            if side == "tail":
                tail.insert(0, rest.pop())
            else:
                head.append(rest.pop(0))
    out = "".join(head) + "..." + "".join(tail)
    if len(out) > width:  # the first and last segments alone are too long
        keep = max(1, width - 3)
        out = key[: keep - keep // 2] + "..." + key[len(key) - keep // 2:]
    return out


def table(header: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[int] = ()) -> list[str]:
    """Lines of an aligned table: each column as wide as its widest cell; columns in ``right`` right-aligned.
    Cells are ``clean``ed; the last column is not padded (no trailing blanks)."""
    cells = [[clean(c) for c in header]] + [[clean(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for r in cells:
        parts = [r[i].rjust(widths[i]) if i in right else r[i].ljust(widths[i]) for i in range(len(r))]
        lines.append("  ".join(parts).rstrip())
    return lines
