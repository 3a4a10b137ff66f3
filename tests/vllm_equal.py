"""THE deep-equality helper for vLLM objects crossing the adapter.

Strict: the same types all the way down (a tuple of lists stays a tuple of
lists, ``int`` is not ``float``), None stays None and empty stays empty, dict
key order is compared (it drives batch order), sets compare as sets, tensors and
arrays are bitwise equal with dtype and shape, dataclasses / msgspec Structs /
NamedTuples compare every field -- private normalised ``SamplingParams`` fields
included.  ``differences(a, b)`` names where two objects differ.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgspec
import numpy as np

from protocol.tensors import tensors_equal


def _fields(obj: Any) -> list[str] | None:
    if isinstance(obj, msgspec.Struct):
        return list(obj.__struct_fields__)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [f.name for f in dataclasses.fields(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return list(obj._fields)
    return None


def _is_tensor(obj: Any) -> bool:
    return isinstance(obj, np.ndarray) or type(obj).__module__.startswith("torch")


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths at which ``a`` and ``b`` differ (empty when strictly equal)."""
    here = path or "<root>"
    if type(a) is not type(b):
        return [f"{here}: type {type(a).__name__} != {type(b).__name__}"]
    if a is None or isinstance(a, (bool, int, float, str, bytes, enum.Enum)):
        same = a == b or (isinstance(a, float) and a != a and b != b)
        return [] if same else [f"{here}: {a!r} != {b!r}"]
    if _is_tensor(a):
        return [] if tensors_equal(a, b) else [f"{here}: tensors differ"]
    names = _fields(a)
    if names is not None:
        out: list[str] = []
        for name in names:
            out += differences(getattr(a, name), getattr(b, name), f"{path}.{name}")
        return out
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{here}: length {len(a)} != {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{here}: keys {list(a)!r} != {list(b)!r}"]
        out = []
        for k in a:
            out += differences(a[k], b[k], f"{path}[{k!r}]")
        return out
    if isinstance(a, (set, frozenset)):
        return [] if a == b else [f"{here}: {sorted(a, key=repr)!r} != {sorted(b, key=repr)!r}"]
    return [] if a == b else [f"{here}: {a!r} != {b!r}"]


def vllm_equal(a: Any, b: Any) -> bool:
    """Strict deep equality (see the module docstring)."""
    return not differences(a, b)


def assert_vllm_equal(a: Any, b: Any) -> None:
    diff = differences(a, b)
    assert not diff, "objects differ:\n  " + "\n  ".join(diff[:20])
