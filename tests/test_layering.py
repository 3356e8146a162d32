"""Layers point down, and each module keeps its privates: the import rules of the fastckpt packages.

Everything here reads the source with ``ast``; nothing is imported. Scope: every ``.py`` file of
``fastckpt/`` (recursively), ``fastckpt_lightning/``, ``fastckpt_accelerate/``, ``benchmarks/`` and
``tools/``. An import counts wherever it is written: module level, inside a function, and under ``if
TYPE_CHECKING:`` too (it never runs, yet it still ties the two files: each must be read with the other, and a
circle hidden there is a circle; a type both sides need goes into a leaf module, a reader's type becomes a
Protocol). Relative imports are resolved to absolute names, ``from pkg import
submodule`` counts as an import of the submodule, and ``from fastckpt import Name`` as an import of the
module that defines ``Name`` (``fastckpt._EXPORTS``).

The layers of ``fastckpt/``, lowest first. A module may import its own folder and any lower rank, never a
higher one:

    0  errors.py, yamlfile.py, config.py (+ configbase.py, configtime.py)
                               anyone may import them; config imports only errors and yamlfile, yamlfile only
                               errors, errors nothing
    1  storage/                where bytes go
       cudart.py               torch's own CUDA runtime and the streams only fastckpt uses; imports only errors
    2  format/                 what a checkpoint is
    3  engine/  read/          how a save runs / how a load runs: siblings, neither imports the other
    4  tiers/                  where checkpoints live
    5  checkpointer.py, timeline.py
    6  cli/                    the ``fastckpt`` command
       __init__.py, __main__.py: the facade, exempt

No import circle between modules, nor between folders. The integrations, the command, the benchmarks and
the tools reach the core only through the public API (``fastckpt.__all__``) and the few names of ``SURFACE``
(module -> names; documented in docs/API.md, "The integration surface").
"""

from __future__ import annotations

import ast
import re
from collections import deque
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fastckpt", "fastckpt_lightning", "fastckpt_accelerate")  # the product
SCOPE = (*PACKAGES, "benchmarks", "tools")  # what these rules read

# What the integrations, ``fastckpt/cli/``, ``benchmarks/`` and ``tools/`` may import from the core besides
# ``import fastckpt`` and the names of ``fastckpt.__all__``: module -> the names they may import from it (ALL: the
# module itself and any public name of it). Keep it short and exact, only names in use: each is a promise.
# docs/API.md's section "## The integration surface" lists the same pairs, each module with why.
ALL = "*"
SURFACE: dict[str, frozenset[str] | str] = {
    # the exception types; Accelerate re-raises another rank's error by its class name (getattr on the module)
    "fastckpt.errors": ALL,
    # model.load_state_dict as a safe point: the pre-hooks both integrations install (picklable, weak)
    "fastckpt.engine.loadwait": frozenset({"guard_loads", "guard_optimizer_loads", "foreign_load_hooks"}),
    # merging a framework's config sources into a CheckpointConfig; the schema's sections (tools/configref);
    # YAML from the command line, bounded like a config file
    "fastckpt.config": frozenset({"config_mapping", "SECTIONS", "load_yaml"}),
    # names read from disk, checked before they are joined to a path
    "fastckpt.format.paths": frozenset({"confine", "plain_name"}),
    # CRC32C of bytes an integration reads itself
    "fastckpt.format.checksum": frozenset({"crc32c", "combine"}),
    # recognising, finding and listing a core checkpoint (no torch: `fastckpt list` never imports it)
    "fastckpt.format.manifest": frozenset({"MANIFEST", "LAYOUT_FILES", "checkpoint_dir", "parse_manifest"}),
    # torch's zip format as data: the .ckpt Lightning's save_file writes, pytorch_model.bin, and their checks
    "fastckpt.format.torchfile": frozenset({"is_zip", "record_spans", "verify_torch_file", "verify_torch_bytes"}),
    # whether a torch file's pickle loads under the loader that will read it; numpy's safe globals (Accelerate's
    # registered objects, checked at save time and loaded with them)
    "fastckpt.format.picklecheck": frozenset({"PickleLoader", "allowing", "numpy_safe_globals", "resolve_globals"}),
    # a bundle's in-progress marker and its file kinds (Accelerate's save folders; EXTERNAL: a file every process
    # uploads parts of, which the bundle waits for); staging_path: where a staged folder is written until its commit
    "fastckpt.format.bundle": frozenset({"PENDING", "SAFETENSORS", "TORCH", "EXTERNAL", "staging_path"}),
    # a torch file's health record (NaN/Inf, norms; Lightning's .ckpt): its extended attribute on local storage,
    # a sidecar beside it on an object store (removed with the file)
    "fastckpt.format.healthrecord": frozenset({"delete_with_record", "file_health", "verdict"}),
    # a torch file's tree without torch, nothing in it run: the step `fastckpt list` shows (a .ckpt, optimizer.bin)
    "fastckpt.format.picklepeek": frozenset({"TensorStub", "peek", "scalar_value"}),
    # the I/O workers' one pass (health statistics + CRC32C), timed alone by benchmarks/health_micro.py
    "fastckpt.format.healthpass": frozenset({"tensor_pass"}),
    # safetensors' name of a torch dtype, to check a model file's header
    "fastckpt.format.safetensorsfile": frozenset({"st_dtype"}),
    # parallel, verified ranged reads, for the loads an integration drives itself
    "fastckpt.read.readers": frozenset({"PIECE_BYTES", "Range", "prefetch", "read_ranges", "tensor_bytes",
                                        "pread_all"}),
    # the fast, checked reader of torch zip files
    "fastckpt.read.torchzip": frozenset({"load_torch_file", "check_records", "load_zip_buffer"}),
    # checking a core checkpoint's bytes without loading it
    "fastckpt.read.verify": frozenset({"verify_checkpoint"}),
    # a root's checkpoints and what retention drops (the command's gc, Lightning's cleanup)
    "fastckpt.tiers.catalog": frozenset({"Catalog", "doomed"}),
    # collecting a root's dropped checkpoints and leftover temp files
    "fastckpt.tiers.gc": frozenset({"collect", "collect_temp_files", "is_save_folder"}),
    # the root's lock, held while the command changes a root
    "fastckpt.tiers.lock": frozenset({"RootLock"}),
    # finishing saves in flight before the process exits (Accelerate)
    "fastckpt.engine.exithook": frozenset({"register_exit_hook"}),
    # the one estimate of a median and its noise, shared by the demo and the benchmarks
    "fastckpt.timeline": frozenset({"median_and_noise"}),
}
SURFACE_USERS = ("fastckpt_lightning", "fastckpt_accelerate", "fastckpt.cli", "benchmarks", "tools")

RANKS = {"errors": 0, "yamlfile": 0, "config": 0, "configbase": 0, "configtime": 0, "storage": 1, "cudart": 1,
         "format": 2, "engine": 3, "read": 3, "tiers": 4, "checkpointer": 5, "timeline": 5, "cli": 6}
SIBLINGS = {("engine", "read"), ("read", "engine")}
ONLY = {"errors": set(), "yamlfile": {"errors"}, "config": {"errors", "yamlfile", "configbase", "configtime"},
        "configbase": {"errors"}, "configtime": {"errors", "configbase"},
        "cudart": {"errors"}}  # the units these may import (besides themselves)
FACADE = ("fastckpt", "fastckpt.__main__")

# Private attributes of third-party objects that an integration reads on purpose, and that merely share
# their name with a private of ours (rule 5 matches names only): package -> names.
THIRD_PARTY_PRIVATES = {
    "fastckpt_accelerate": {"_optimizers"},  # accelerate.Accelerator._optimizers
    # LightningOptimizer._optimizer, ModelCheckpoint._fs, FSDPStrategy._state_dict_type (fastckpt_lightning/bypass.py)
    "fastckpt_lightning": {"_optimizer", "_fs", "_state_dict_type"},
}

MAX_FILE_LINES = 500
MAX_CHECKPOINTER_LINES = 320


class Import(NamedTuple):
    line: int
    named: str  # the module the statement names (``fastckpt`` for ``from fastckpt import X``)
    name: str | None  # the name imported from it, if any
    target: str  # the module this import loads, resolved (a known module of the scope)


# ---- reading the sources -------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    """``dotted.name -> path`` of every module in the scope."""
    found = {}
    for top in SCOPE:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


@lru_cache(maxsize=None)
def tree(module: str) -> ast.Module:
    path = modules()[module]
    return ast.parse(path.read_text(), str(path))


def rel(module: str) -> str:
    return str(modules()[module].relative_to(ROOT))


@lru_cache(maxsize=None)
def exports() -> dict[str, str]:
    """``fastckpt._EXPORTS``: public name -> absolute module that defines it."""
    for node in tree("fastckpt").body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return {k: _absolute("fastckpt", True, 1, v.lstrip(".")) for k, v in ast.literal_eval(node.value).items()}
    raise AssertionError("fastckpt/__init__.py has no _EXPORTS")


def public_api() -> set[str]:
    return set(exports())  # ``__all__ = list(_EXPORTS)``


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _ours(name: str) -> bool:
    return name.split(".")[0] in SCOPE


def _known(name: str) -> str:
    """The deepest known module that ``name`` is or lies in (``a.b.C`` -> ``a.b``)."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules():
        parts.pop()
    return ".".join(parts)


@lru_cache(maxsize=None)
def imports(module: str) -> tuple[Import, ...]:
    """Every import of a module of the scope written in ``module``, resolved."""
    is_package = modules()[module].name == "__init__.py"
    found = []
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name) and _known(alias.name):
                    found.append(Import(node.lineno, alias.name, None, _known(alias.name)))
        elif isinstance(node, ast.ImportFrom):
            named = _absolute(module, is_package, node.level, node.module)
            if not _ours(named) or not _known(named):
                continue
            for alias in node.names:
                submodule = f"{named}.{alias.name}"
                if submodule in modules():
                    target = submodule
                elif named == "fastckpt" and alias.name in exports():
                    target = exports()[alias.name]
                else:
                    target = _known(named)
                found.append(Import(node.lineno, named, alias.name, target))
    return tuple(sorted(found))


def graph() -> dict[str, set[str]]:
    return {m: {i.target for i in imports(m) if i.target != m} for m in modules()}


def unit(module: str) -> str | None:
    """The layer unit of a core module: its folder (``storage``...) or its own name (``config``...);
    ``None`` outside ``fastckpt`` and for the facade."""
    parts = module.split(".")
    if parts[0] != "fastckpt" or module in FACADE:
        return None
    return parts[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Deterministic: for each node in a circle, the shortest circle through it (each circle once)."""
    found, seen = [], set()
    for start in sorted(edges):
        parents, todo = {}, deque([start])
        while todo and start not in parents:
            node = todo.popleft()
            for nxt in sorted(edges.get(node, ())):
                if nxt not in parents:
                    parents[nxt] = node
                    todo.append(nxt)
        if start not in parents:
            continue
        chain, node = [start], parents[start]
        while node != start:
            chain.append(node)
            node = parents[node]
        chain = [start] + chain[:0:-1]  # start, then the path back to it in import order
        key = frozenset(zip(chain, chain[1:] + chain[:1]))
        if key not in seen:
            seen.add(key)
            found.append(chain)
    return found


# ---- 1. private names are not imported -----------------------------------------------------------------


def test_no_private_name_is_imported_across_modules():
    reaches = [f"{rel(m)}:{i.line}: from {i.named} import {i.name}" for m in modules() for i in imports(m)
               if i.name and i.name.startswith("_") and not i.name.startswith("__") and i.target != m]
    assert modules(), f"no modules found under {ROOT}"
    assert reaches == [], ("these import another module's private name; give the helper a public name in a "
                           "module below both:\n" + "\n".join(reaches))


# ---- 2. no import circles ------------------------------------------------------------------------------


def test_no_import_circle_between_modules():
    found = [" -> ".join(c + c[:1]) for c in cycles(graph())]
    assert found == [], ("modules import each other in a circle; move what both need into a module below both "
                         "(or merge them):\n" + "\n".join(found))


def test_no_import_circle_between_folders_of_fastckpt():
    edges: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for m in modules():
        for i in imports(m):
            a, b = unit(m), unit(i.target)
            if a and b and a != b:
                edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{rel(m)}:{i.line} imports {i.target}")
    found = []
    for c in cycles(edges):
        steps = list(zip(c, c[1:] + c[:1]))
        found.append(" -> ".join(c + c[:1]) + "  (" + "; ".join(why[s] for s in steps) + ")")
    assert found == [], ("folders of fastckpt import each other in a circle; the lower one must not know the "
                         "higher (see the layer order in this file's docstring):\n" + "\n".join(found))


# ---- 3. layers point down ------------------------------------------------------------------------------


def _layer_violation(a: str, b: str) -> str | None:
    if a == b:
        return None
    if a in ONLY:
        allowed = ", ".join(sorted(ONLY[a])) or "nothing"
        return None if b in ONLY[a] else f"{a} may import {allowed} of fastckpt, no more"
    if (a, b) in SIBLINGS:
        return f"{a} and {b} are siblings: neither imports the other"
    if RANKS[b] > RANKS[a]:
        return f"{a} (rank {RANKS[a]}) must not import {b} (rank {RANKS[b]})"
    return None


def test_each_fastckpt_folder_imports_only_folders_below_it():
    assert set(RANKS) == {unit(m) for m in modules() if unit(m)}, "a new folder or top-level module: rank it"
    found = []
    for m in modules():
        for i in imports(m):
            a, b = unit(m), unit(i.target)
            if a and b and (reason := _layer_violation(a, b)):
                found.append(f"{rel(m)}:{i.line}: imports {i.target}: {reason}")
    assert found == [], ("imports that point up the layers (order in this file's docstring); move the shared "
                         "code down, or pass what is needed in as an argument:\n" + "\n".join(found))


# ---- 4. the integration surface ------------------------------------------------------------------------


def _surface_user(module: str) -> bool:
    return any(module == u or module.startswith(u + ".") for u in SURFACE_USERS)


def _on_surface(i: Import) -> bool:
    """``from M import name`` with ``name`` listed for ``M`` in SURFACE, or an import of ``M`` itself (``import M``,
    ``from pkg import M``) where SURFACE lets the whole of ``M`` through."""
    allowed = SURFACE.get(i.target)
    if allowed is None:
        return False
    whole_module = i.name is None or f"{i.named}.{i.name}" == i.target
    if allowed == ALL:
        return True
    return not whole_module and i.named == i.target and i.name in allowed


def _surface_reaches() -> list[str]:
    found = []
    for m in modules():
        if not _surface_user(m):
            continue
        for i in imports(m):
            if unit(i.target) is None and i.target not in FACADE:
                continue  # not the core
            if m.startswith("fastckpt.cli") and i.target.startswith("fastckpt.cli"):
                continue  # the command's own modules
            if i.named == "fastckpt" and (i.name is None or i.name in public_api() or
                                          (i.name.startswith("__") and i.name.endswith("__"))):
                continue  # ``import fastckpt``, ``from fastckpt import <public name or __version__>``
            if _on_surface(i):
                continue
            what = f"from {i.named} import {i.name}" if i.name else f"import {i.named}"
            found.append(f"{rel(m)}:{i.line}: {what}  (-> {i.target})")
    return found


def test_integrations_use_only_the_public_api_and_the_surface():
    found = _surface_reaches()
    assert found == [], ("the integrations, fastckpt/cli, benchmarks and tools may import from fastckpt only the "
                         "names of fastckpt.__all__ and the names of SURFACE; export what they need from fastckpt, "
                         "or (rarely) add the name to SURFACE and to docs/API.md:\n" + "\n".join(found))


def _surface_in(text: str) -> dict[str, frozenset[str] | str]:
    """The pairs a section lists, one line per module: ``- `module` (`name`, `name`): why`` or
    ``- `module` (all): why``."""
    listed: dict[str, frozenset[str] | str] = {}
    for module, names in re.findall(r"^- `(fastckpt[\w.]*)` \(([^)]*)\)", text, re.M):
        listed[module] = ALL if names.strip() == "all" else frozenset(re.findall(r"`(\w+)`", names))
    return listed


def test_api_doc_lists_the_integration_surface():
    text = (ROOT / "docs" / "API.md").read_text()
    match = re.search(r"^## The integration surface\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "docs/API.md needs a section '## The integration surface' listing SURFACE"
    listed = _surface_in(match.group(1))
    shown = lambda d: {m: n if n == ALL else sorted(n) for m, n in sorted(d.items())}  # noqa: E731
    assert listed == SURFACE, (
        f"docs/API.md's integration surface lists {shown(listed)}, tests/test_layering.py's SURFACE is "
        f"{shown(SURFACE)}: make them the same")
    assert all(m in modules() for m in SURFACE), [m for m in SURFACE if m not in modules()]


def test_surface_names_exist_and_are_not_public_already():
    """Each name of SURFACE is defined (or imported) at the top level of its module, and is not a name of
    ``fastckpt.__all__`` (those come from ``fastckpt``)."""
    found = []
    for module, names in SURFACE.items():
        if names == ALL:
            continue
        defined = set()
        for node in tree(module).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    defined.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        found += [f"{module}.{n}: not defined there" for n in sorted(names - defined)]
        found += [f"{module}.{n}: public, import it from fastckpt" for n in sorted(names & public_api())]
    assert found == [], "\n".join(found)


# ---- 5. private attributes stay in their module --------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@lru_cache(maxsize=None)
def defined_privates(module: str) -> frozenset[str]:
    """Private names ``module`` defines as attributes: ``self._x =``/``cls._x =``, ``def _x``, ``class _X``,
    class- or module-level ``_x = ...`` and ``_x: T`` (dataclass fields)."""
    names: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not in_function:
                    names.add(child.name)
                visit(child, in_function or not isinstance(child, ast.ClassDef))
                continue
            targets = []
            if isinstance(child, ast.Assign):
                targets = child.targets
            elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                targets = [child.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name) and not in_function:
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                            t.value.id in ("self", "cls"):
                        names.add(t.attr)
            visit(child, in_function)

    visit(tree(module), False)
    return frozenset(n for n in names if _private(n))


def _private_reaches() -> list[str]:
    owners: dict[str, list[str]] = {}
    for m in modules():
        for name in defined_privates(m):
            owners.setdefault(name, []).append(m)
    found = []
    for m in modules():
        mine = defined_privates(m) | THIRD_PARTY_PRIVATES.get(m.split(".")[0], set())
        for node in ast.walk(tree(m)):
            uses = []
            if isinstance(node, ast.Attribute) and _private(node.attr):
                value = node.value
                is_self = isinstance(value, ast.Name) and value.id in ("self", "cls")
                is_super = isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super"
                if not (is_self or is_super):
                    uses.append((ast.unparse(value), node.attr))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and _private(node.args[1].value):
                uses.append((ast.unparse(node.args[0]), node.args[1].value))
            for owner_expr, name in uses:
                elsewhere = [o for o in owners.get(name, ()) if o != m]
                if elsewhere and name not in mine:
                    found.append(f"{rel(m)}:{node.lineno}: {owner_expr}.{name} (defined in "
                                 f"{', '.join(rel(o) for o in sorted(elsewhere))})")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


def test_no_private_attribute_is_reached_across_modules():
    found = _private_reaches()
    assert found == [], ("these reach another module's private attribute; give it a public name (a method or "
                         "property of its owner) or move the code into the owner:\n" + "\n".join(found))


# ---- 6, 7. sizes ---------------------------------------------------------------------------------------


def test_no_product_file_is_over_500_lines():
    found = []
    for m, path in modules().items():
        if m.split(".")[0] in PACKAGES:
            lines = len(path.read_text().splitlines())
            if lines > MAX_FILE_LINES:
                found.append(f"{rel(m)}: {lines} lines")
    assert found == [], (f"files over {MAX_FILE_LINES} lines; split each along a concept it owns into a module "
                         "of its folder:\n" + "\n".join(found))


def test_checkpointer_class_is_at_most_320_lines():
    body = tree("fastckpt.checkpointer").body
    classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == "Checkpointer"]
    assert len(classes) == 1, "fastckpt/checkpointer.py must define class Checkpointer"
    node = classes[0]
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    span = node.end_lineno - start + 1
    assert span <= MAX_CHECKPOINTER_LINES, (
        f"class Checkpointer spans {span} lines (fastckpt/checkpointer.py:{start}-{node.end_lineno}), at most "
        f"{MAX_CHECKPOINTER_LINES}: it should delegate (the engine saves, read/ loads, tiers/ keep), not do")
