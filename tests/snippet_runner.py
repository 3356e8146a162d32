"""Runs one documentation block as a reader would (``python snippet.py``) and fails it when fastckpt warned.

``tests/test_doc_snippets.py`` runs every block through this: a documented snippet must run without a warning from
fastckpt, or the warning is wrong, or the doc is (issue 55, item 4). "From fastckpt" means a ``warnings.warn``
called by code of ``fastckpt``, ``fastckpt_lightning`` or ``fastckpt_accelerate`` (found on the call stack, so
whatever ``stacklevel`` the warning names the user's line with), or a record of WARNING or above on one of their
loggers. Warnings of other libraries (Lightning's tips, torch deprecations) are the reader's environment, not the
doc's, and only pass through. A block whose doc explains what fastckpt says there (its ``warns: TEXT`` directive)
runs with ``FASTCKPT_SNIPPET_WARNS=TEXT``: what contains ``TEXT`` is allowed. Everything said is printed as usual; the exit status is 3 when fastckpt said
anything, checked once the process is done (after the exit hooks that flush pending saves, which may warn too).
"""

from __future__ import annotations

import atexit
import logging
import os
import runpy
import sys
import warnings
from typing import Any

PACKAGES = ("fastckpt", "fastckpt_lightning", "fastckpt_accelerate")
SAID_SOMETHING = 3
EXPECTED_ENV = "FASTCKPT_SNIPPET_WARNS"


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _issuer() -> str:
    """The module that called ``warnings.warn``: the first frame below ``showwarning`` outside ``warnings``."""
    frame = sys._getframe(2)  # 0: this, 1: the hook; then warnings._showwarnmsg, then the caller of warn()
    while frame is not None and frame.f_globals.get("__name__") == "warnings":
        frame = frame.f_back
    return "" if frame is None else str(frame.f_globals.get("__name__", ""))


def main(path: str) -> None:
    said: list[str] = []
    shown = warnings.showwarning
    expected = os.environ.pop(EXPECTED_ENV, "")  # popped: the block's own child processes never see it

    def hook(message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        issuer = _issuer()
        if _ours(issuer) and not (expected and expected in str(message)):
            said.append(f"warnings.warn from {issuer}: {category.__name__}: {message}")
        shown(message, category, filename, lineno, file, line)

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if _ours(record.name) and not (expected and expected in record.getMessage()):
                said.append(f"logged by {record.name} at {record.levelname}: {record.getMessage()}")
            logging.lastResort.handle(record)  # still shown, as without a handler (the root has none)

    def report() -> None:  # registered first, so it runs last: after fastckpt's own exit hooks
        if not said:
            return
        print("\nfastckpt warned while this documented block ran (fix the code or the doc, or say why in the doc "
              "and change the block so that it is not said):", file=sys.stderr)
        for line in said:
            print(f"  {line}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(SAID_SOMETHING)

    atexit.register(report)
    logging.getLogger().addHandler(Catch(logging.WARNING))
    warnings.showwarning = hook
    warnings.simplefilter("default")  # each warning shown once per place, DeprecationWarnings included
    sys.argv = [path]
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python snippet.py` sets it
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1])
