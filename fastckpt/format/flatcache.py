"""The previous save's flattening, reused: ``save()`` walks the state once and checks it against a skeleton.

A training loop saves the same structure every time: the same containers and keys, the same tensors at the same
addresses (the optimizer and the model update them in place), only the plain values (a step count, the learning
rate) and the bytes change. ``flatten`` (format/plan.py) rebuilds the tensor table and the JSON tree on every call:
a Python call or two per tree node and a torch call or five per tensor, 5-10 ms of a 588-tensor state on the 2-core
benchmark host, on the training thread inside ``save()``. ``FlatCache`` keeps the *skeleton* of the last state it
flattened: its containers (type, keys, length), which leaf is a tensor, a plain value or a pickled object, and each
tensor leaf's identity (data address, shape, strides, dtype, neg bit). A later state passes the identity check when

- every container has the same exact type, keys (in order, of the same types) and length: checked container by
  container, a dict of leaves in one list comparison (``list(d) == keys``), a dict of such dicts (an optimizer's
  per-parameter state) in a handful of C-level calls for all of them;
- every leaf has the same exact type (one ``map(type, leaves)`` compared as a list);
- every tensor leaf has the same data address, shape, strides, dtype and neg bit (one ``map`` per attribute over
  all tensors, each compared as a list: no Python call per tensor).

It then gets the previous tensor table (the dedup of tied views holds: it depends on those identities only), keys,
plan key and identities, and a tree that is encoded later, off the training thread (``DeferredTree``: the plain
leaves are immutable values, captured as they are now; the pickled objects are pickled inside ``save()`` as
always). Anything else (a key added, a tensor replaced, reshaped, re-allocated, of another dtype) fails the check,
and the state is flattened in full and becomes the new skeleton. States the skeleton does not describe are always
flattened in full: DTensors, numpy arrays and scalars (converted or checked per value), tensor subclasses, empty
tensors (their identity is not their address), a state that is itself a leaf.
"""
from __future__ import annotations

import operator
from itertools import chain
from typing import Any, Callable

import torch

from .codec import encode_tree
from .plan import FlatState, flatten

__all__ = ["FlatCache", "DeferredTree", "tree_json"]

# Leaf types whose JSON depends on the value alone and never fails (immutable: captured in save(), encoded later).
_PLAIN = frozenset({str, bool, type(None), int, float, bytes, torch.dtype, torch.device, torch.Size})
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
_T = torch._C.TensorBase
_ptr, _stride, _neg, _conj = _T.data_ptr, _T.stride, _T.is_neg, _T.is_conj
_shape, _dtype = operator.attrgetter("shape"), operator.attrgetter("dtype")
_LEAVES, _FLAT_DICTS, _MIXED = 0, 1, 2  # how a container's children are collected


def _is_container(obj: Any) -> bool:
    """What ``encode_tree`` walks into (everything else is a leaf)."""
    kind = type(obj)
    return kind is list or kind is tuple or isinstance(obj, dict)


def _pick(positions: list[int]) -> Callable[[list[Any]], list[Any]]:
    """A C-level gather of ``positions`` from a list (``itemgetter`` returns a bare item for one position)."""
    if not positions:
        return lambda _leaves: []
    if len(positions) == 1:
        only = positions[0]
        return lambda leaves: [leaves[only]]
    get = operator.itemgetter(*positions)
    return lambda leaves: list(get(leaves))


class _Node:
    """One container of the skeleton. ``children[i]`` is None for a leaf."""

    __slots__ = ("kind", "is_dict", "keys", "key_types", "n", "children", "mode", "child_types", "child_keys",
                 "child_lens", "enc_keys", "extra")

    def __init__(self, obj: Any, enc: Any, on_leaf: Callable[[Any, Any], None]) -> None:
        self.kind = type(obj)
        self.is_dict = isinstance(obj, dict)
        self.n = len(obj)
        if self.is_dict:
            keys = list(obj)
            if any(type(k) not in _PLAIN for k in keys):
                raise _Unfit  # a key encoded as a tensor or an object: walked in full every time
            self.keys = keys
            # str keys: equal keys are str keys, the same JSON; other keys also need their types (1 == 1.0 == True)
            self.key_types = None if all(type(k) is str for k in keys) else [type(k) for k in keys]
            self.enc_keys = [pair[0] for pair in enc["D"]]
            self.extra = {k: v for k, v in enc.items() if k != "D"}
            values, encoded = list(obj.values()), [pair[1] for pair in enc["D"]]
        else:
            self.keys, self.key_types, self.enc_keys, self.extra = None, None, None, None
            values, encoded = list(obj), enc["L" if self.kind is list else "U"]
        children: list[_Node | None] = []
        for v, e in zip(values, encoded):
            if _is_container(v):
                children.append(_Node(v, e, on_leaf))
            else:
                children.append(None)
                on_leaf(v, e)
        self.children = children
        self.child_types = self.child_keys = self.child_lens = None
        if all(c is None for c in children):
            self.mode = _LEAVES
        elif children and all(c is not None and c.is_dict and c.mode == _LEAVES and c.key_types is None
                              for c in children):
            self.mode = _FLAT_DICTS  # an optimizer's state: {param index: {"step": t, "exp_avg": t, ...}}
            self.child_types = [c.kind for c in children]  # type: ignore[union-attr]
            # their keys as one list (a dict iterates its keys) and each one's count: two flat lists compared, not a
            # list per child dict
            self.child_keys = [k for c in children for k in c.keys]  # type: ignore[union-attr]
            self.child_lens = [c.n for c in children]  # type: ignore[union-attr]
        else:
            self.mode = _MIXED

    def collect(self, obj: Any, out: list[Any]) -> bool:
        """Append ``obj``'s leaves to ``out`` in walk order; False where ``obj`` does not match this container."""
        if type(obj) is not self.kind or len(obj) != self.n:
            return False
        if self.is_dict:
            keys = list(obj)
            if keys != self.keys or (self.key_types is not None and list(map(type, keys)) != self.key_types):
                return False
            values = obj.values()
        else:
            values = obj
        mode = self.mode
        if mode == _LEAVES:
            out.extend(values)
            return True
        if mode == _FLAT_DICTS:
            values = list(values)
            if (list(map(type, values)) != self.child_types or list(map(len, values)) != self.child_lens
                    or list(chain.from_iterable(values)) != self.child_keys):
                return False
            out.extend(chain.from_iterable(map(dict.values, values)))
            return True
        append = out.append
        for v, child in zip(values, self.children):
            if child is None:
                append(v)
            elif not child.collect(v, out):
                return False
        return True

    def encode(self, leaves: Any) -> Any:
        """The JSON of this container, its leaves' JSON taken from the iterator ``leaves`` in walk order."""
        if self.is_dict:
            items = [[k, next(leaves) if child is None else child.encode(leaves)]
                     for k, child in zip(self.enc_keys, self.children)]  # type: ignore[arg-type]
            return {"D": items, **self.extra}  # type: ignore[dict-item]
        body = [next(leaves) if child is None else child.encode(leaves) for child in self.children]
        return {"L": body} if self.kind is list else {"U": body}


class _Skeleton:
    """The last flattened state's structure and tensor identities; ``match`` is the identity check."""

    def __init__(self, state: Any, flat: FlatState) -> None:
        """Raises ``_Unfit`` for a state the skeleton does not describe (always flattened in full)."""
        if flat.dtensors or any(flat.numpy) or not _is_container(state):
            raise _Unfit
        kinds: list[str] = []  # per leaf: "t" tensor, "o" pickled object, "p" plain value
        tensor_index: list[int] = []

        def on_leaf(value: Any, enc: Any) -> None:
            kind = type(value)
            if kind in _TENSORS:
                kinds.append("t")
                tensor_index.append(enc["T"])
            elif kind in _PLAIN:
                kinds.append("p")
            elif isinstance(enc, dict) and "P" in enc and not _special(value):
                kinds.append("o")
            else:  # numpy scalars, tensor subclasses, ...: encoded (and checked) value by value
                raise _Unfit

        self.root = _Node(state, flat.tree, on_leaf)
        leaves: list[Any] = []
        if not self.root.collect(state, leaves):  # cannot happen; a skeleton that fails its own state is useless
            raise _Unfit
        self.leaf_types = list(map(type, leaves))
        self.kinds = kinds
        tensor_pos = [i for i, k in enumerate(kinds) if k == "t"]
        self.tensors = _pick(tensor_pos)
        self.objects = _pick([i for i, k in enumerate(kinds) if k == "o"])
        self.plain = _pick([i for i, k in enumerate(kinds) if k == "p"])
        self.tensor_index = tensor_index
        first: dict[int, int] = {}
        for pos, index in zip(tensor_pos, tensor_index):
            first.setdefault(index, pos)
        if sorted(first) != list(range(len(flat.tensors))):
            raise _Unfit
        self.table = _pick([first[i] for i in range(len(flat.tensors))])
        self.dups = len(tensor_pos) != len(first)  # tied views share an entry: the table is a subset of the leaves
        ts = self.tensors(leaves)
        # the conj bit exists on complex tensors only: asked of those alone (usually none)
        self.complex = _pick([p for p, t in zip(tensor_pos, ts) if t.dtype.is_complex])
        self.sig = self._signature(leaves)
        if 0 in self.sig[0]:
            raise _Unfit  # an empty tensor's identity is its storage, not an address
        # the table's lists, shared read-only by every save that reuses them (never the tensors: a skeleton must not
        # keep a replaced model's memory alive)
        self.keys, self.numpy, self.owners = flat.keys, flat.numpy, flat.owners
        self.object_keys, self.ids = flat.object_keys, flat.identities()
        self.memo: dict[Any, Any] = {}  # what the engine derives from this structure once (engine/seal.py, saver.py)

    def match(self, state: Any) -> list[Any] | None:
        """The leaves of ``state`` where it passes the identity check, else None."""
        leaves: list[Any] = []
        try:
            if not self.root.collect(state, leaves) or list(map(type, leaves)) != self.leaf_types:
                return None
            if self._signature(leaves) != self.sig:
                return None
        except Exception:  # noqa: BLE001 - a dict whose iteration fails, a tensor without strides: flattened in
            return None  # full, which raises what it must
        return leaves

    def _signature(self, leaves: list[Any]) -> tuple[list[Any], ...]:
        """Each tensor leaf's identity as lists, one C-level ``map`` per attribute (no Python call per tensor): data
        address, shape, strides, dtype, neg bit, and the conj bit of the complex ones."""
        ts = self.tensors(leaves)
        return (list(map(_ptr, ts)), list(map(_shape, ts)), list(map(_stride, ts)), list(map(_dtype, ts)),
                list(map(_neg, ts)), list(map(_conj, self.complex(leaves))))

    def reuse(self, leaves: list[Any]) -> FlatState:
        """The ``FlatState`` of a state whose ``leaves`` passed ``match``."""
        tensors = self.table(leaves) if self.dups else self.tensors(leaves)
        objects = self.objects(leaves)
        return FlatState(tree=DeferredTree(self, self.plain(leaves), len(objects)), tensors=tensors, keys=self.keys,
                         numpy=self.numpy, objects=objects, owners=self.owners, lazy_src=tensors[:], dtensors=[],
                         object_keys=self.object_keys, ids=self.ids, token=self)

    def encode(self, plain: list[Any], n_objects: int) -> Any:
        """The JSON tree of a state with these plain leaves (what ``encode_tree`` gives for it)."""
        plain_iter, objects, tensors = iter(plain), iter(range(n_objects)), iter(self.tensor_index)
        enc: list[Any] = []
        for kind in self.kinds:
            if kind == "t":
                enc.append({"T": next(tensors)})
            elif kind == "o":
                enc.append({"P": next(objects)})
            else:
                enc.append(encode_tree(next(plain_iter), _no_tensor, []))
        return self.root.encode(iter(enc))


class _Unfit(Exception):
    """A state the skeleton does not describe."""


def _special(value: Any) -> bool:
    """Leaves ``encode_tree`` treats by more than their type (numpy values, tensor subclasses): never deferred."""
    kind = type(value)
    return isinstance(value, torch.Tensor) or kind.__module__.split(".")[0] == "numpy"


def _no_tensor(path: tuple, t: torch.Tensor, is_numpy: bool) -> int:
    raise AssertionError("a plain leaf holds no tensor")  # pragma: no cover - _PLAIN leaves only




class DeferredTree:
    """A save's JSON tree, encoded when first asked for (on the copy thread or the committer, not in ``save()``)."""

    __slots__ = ("_skeleton", "_plain", "_objects", "_json")

    def __init__(self, skeleton: _Skeleton, plain: list[Any], objects: int) -> None:
        self._skeleton, self._plain, self._objects = skeleton, plain, objects
        self._json: Any = None

    def json(self) -> Any:
        if self._json is None:  # two threads may both encode it: the same value, no lock needed
            self._json = self._skeleton.encode(self._plain, self._objects)
        return self._json


def tree_json(tree: Any) -> Any:
    """A save's tree as JSON: ``flatten``'s already is; a ``DeferredTree`` is encoded now."""
    return tree.json() if isinstance(tree, DeferredTree) else tree


class FlatCache:
    """``flatten`` with the previous state's skeleton reused (one per ``Saver``; the training thread's)."""

    def __init__(self) -> None:
        self._skeleton: _Skeleton | None = None
        self.reused = 0  # saves whose flattening was reused (tests assert on it)
        self.built = 0  # skeletons built

    def flatten(self, state: Any) -> FlatState:
        """What ``flatten(state)`` gives, reusing the last skeleton where ``state`` passes its identity check."""
        skeleton = self._skeleton
        if skeleton is not None:
            leaves = skeleton.match(state)
            if leaves is not None:
                self.reused += 1
                return skeleton.reuse(leaves)
        flat = flatten(state)  # StateMismatchError names what it cannot walk
        try:
            self._skeleton = _Skeleton(state, flat)
        except _Unfit:
            self._skeleton = None
            return flat
        self.built += 1
        flat.token = self._skeleton
        return flat

    def forget(self) -> None:
        """Drop the skeleton (and the tensors its first state held)."""
        self._skeleton = None


