"""The command line every generated document shares: rewrite the file, or ``--check`` that it matches the code."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def main(prog: str, summary: str, output: Path, render: Callable[[str], str], argv: list[str] | None = None) -> int:
    """``render(current text)`` -> the text the code says ``output`` should hold. Exit 1 with ``--check`` when it
    differs (the tests' way to say "run ``python -m <prog>``"), else write it."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=summary)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from the code")
    parser.add_argument("--out", type=Path, default=output, help=f"default: {output}")
    args = parser.parse_args(argv)
    current = args.out.read_text() if args.out.exists() else ""
    text = render(current)
    if args.check:
        if current != text:
            print(f"{args.out} is out of date: run `python -m {prog}`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0
