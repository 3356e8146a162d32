"""Runs the documented calls of tests/test_doc_calls.py in a fresh interpreter, each in a namespace of its own.

    python -m tests.doc_calls_child CALLS.json RESULTS.json

``CALLS.json`` lists ``{"id", "setup", "call", "check", "teardown"}`` (Python source): ``setup`` binds the names the
call uses, ``call`` is the documented call made executable (an expression; its value is ``result``), ``check``
asserts on ``result``, ``teardown`` runs whatever happened. ``RESULTS.json`` gets ``{id: "ok" | the error}``. One
process for every call: the integrations' imports are paid once, and ``fastckpt_accelerate.enable`` patches
nothing in the pytest process.
"""
from __future__ import annotations

import importlib
import json
import sys
import traceback
from typing import Any


def resolve(dotted: str, *, callable_: bool = True) -> Any:
    """What ``dotted`` names, reached as a reader's script reaches it: attributes, a submodule imported where the
    attribute is not there. ``callable_``: a module or any other value that cannot be called raises TypeError."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[:i]))
    if callable_ and not callable(obj):
        raise TypeError(f"{dotted} is a {type(obj).__name__}, not callable")
    return obj


def run(calls: list[dict[str, str]]) -> dict[str, str]:
    results: dict[str, str] = {}
    for entry in calls:
        ns: dict[str, object] = {}
        try:
            exec(entry["setup"], ns)
            ns["result"] = eval(entry["call"], ns)
            exec(entry["check"], ns)
            results[entry["id"]] = "ok"
        except BaseException:  # noqa: BLE001 - every call is reported, the failures by name
            results[entry["id"]] = traceback.format_exc(limit=4)
        finally:
            try:
                exec(entry["teardown"], ns)
            except BaseException:  # noqa: BLE001
                results[entry["id"]] += "\nteardown: " + traceback.format_exc(limit=2)
    return results


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        todo = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(run(todo), f)
