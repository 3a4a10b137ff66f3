"""Generic kernels: the one typed facade over the optional C module ``protocol._kernels``.

``protocol/_kernels*.c`` (one module, built by ``setup.py`` at install where a C
compiler is found; each file's header says what it holds, ``_kernels.pyi`` types it)
hold the few generic kernels a benchmark shows C pays for: the packers of integer lists
and int64 buffers (references in :mod:`protocol.packing`), the row scans of integer
arrays (references in :mod:`protocol.bitmask`) and three list kernels (references
below).  Nothing here or there knows a message or a vLLM name; nothing else imports the
module.

Two kinds of names:

* the native kernels (``pack_list`` .. ``row_rebuild``): the C function itself, which
  returns exactly what its pure-Python reference returns, or None for an input it does
  not take -- and always None without the module; the caller then runs the reference,
  which decides, errors included;
* whole functions (``single_items``, ``singletons``, ``mismatches``): the C
  kernel where it takes the input, else the ``*_py`` reference beside it.

``tests/test_kernels*.py`` hold every kernel to its reference on generated and hostile
inputs; the bytes on the wire never depend on which one ran.
``DELTACAST_PURE_PYTHON=1`` in the environment selects the pure-Python paths (A/B
benchmarks, fallback tests); ``python -m protocol.kernels`` says which is in use.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

PURE_ENV = "DELTACAST_PURE_PYTHON"

try:
    from protocol import _kernels as _C
except ImportError:  # built without a C compiler: the Python paths
    _C = None  # type: ignore[assignment]
if os.environ.get(PURE_ENV) == "1":
    _C = None  # type: ignore[assignment]

#: whether the C kernels are in use (False: every native kernel returns None)
NATIVE = _C is not None


def status() -> str:
    """One line: which paths this process uses."""
    if _C is not None:
        return f"C kernels in use ({_C.__file__})"
    why = f"{PURE_ENV}=1" if os.environ.get(PURE_ENV) == "1" else "not built (no C compiler?)"
    return f"pure Python: C kernels {why}"


def _not_taken(*_args: object) -> None:
    """A native kernel without the module: never takes the input."""
    return None


# Native kernels.  Packers (references: protocol.packing's Python paths): pack_uints of a
# list of ints in [0, 2**64), pack_sints of a list of ints in the int64 range, pack_uints
# of a C-contiguous int64 buffer without negatives; a well-formed packed array of at most
# ``limit`` values as ints, as zig-zag decoded ints, as native int64 bytes (None too for
# a value past int64).
pack_list: Callable[[list[int]], bytes | None] = _C.pack_list if _C else _not_taken
pack_signed_list: Callable[[list[int]], bytes | None] = _C.pack_signed_list if _C else _not_taken
pack_array: Callable[[Any], bytes | None] = _C.pack_array if _C else _not_taken
raw_list: Callable[[bytes, int], list[int] | None] = _C.raw_list if _C else _not_taken
raw_signed_list: Callable[[bytes, int], list[int] | None] = (
    _C.raw_signed_list if _C else _not_taken)
unpack_array: Callable[[bytes, int], bytearray | None] = _C.unpack_array if _C else _not_taken

# Row scans (references: protocol.bitmask's scan_py, row_refs_py, row_rebuild_py):
# sparse_scan(rows buffer, row count, item size), row_refs(table, rows, width),
# row_rebuild(table, fresh, refs, width).
sparse_scan: Callable[[Any, int, int], tuple[bytes, bytes, bytes] | None] = (
    _C.sparse_scan if _C else _not_taken)
row_refs: Callable[[bytes, Any, int], tuple[list[int], bytes, bytes] | None] = (
    _C.row_refs if _C else _not_taken)
row_rebuild: Callable[[bytes, bytes, list[int], int], tuple[bytearray, bytes] | None] = (
    _C.row_rebuild if _C else _not_taken)


# Digest terms (reference: protocol.digest.row_sums_py): per row, the sum mod 2**64 of
# mix64(v * k_value + p * k_pos + handle * k_handle + salt) over the row's values v at
# positions p = start, start + 1, ... (lists of ints).
row_mix_sums: Callable[[list[int], list[int], list[int], list[int], int, int, int, int],
                       list[int] | None] = _C.row_mix_sums if _C else _not_taken
# (reference: protocol.digest.keyed_sum_py) Σ (counts[i] + plus) * (mix64(handles[i] *
# k_handle + i * k_pos + k_add) | 1) mod 2**64 over two int64 arrays.
keyed_sum: Callable[[Any, Any, int, int, int, int], int | None] = (
    _C.keyed_sum if _C else _not_taken)


def single_items_py(rows: Any) -> list[Any] | None:
    """``[row[0] for row in rows]`` when ``rows`` is a list of one-item lists, else None."""
    if type(rows) is not list or any(type(r) is not list or len(r) != 1 for r in rows):
        return None
    return [r[0] for r in rows]


#: :func:`single_items_py`, in C when built (it takes every input)
single_items: Callable[[Any], list[Any] | None] = _C.single_items if _C else single_items_py


def mismatches_py(values: list[int], array: Any) -> list[int]:
    """The positions where a list of ints departs from an int64 array as long."""
    return [p for p, (a, b) in enumerate(zip(values, array.tolist(), strict=True)) if a != b]


def mismatches(values: list[int], array: Any) -> list[int]:
    """:func:`mismatches_py`, in C where taken (a list of ints as long as the array)."""
    found = _C.mismatches(values, array) if _C is not None else None
    return found if found is not None else mismatches_py(values, array)


def singletons_py(items: Any) -> list[list[Any]] | None:
    """``[[item] for item in items]`` (fresh one-item lists) of a list, else None."""
    return [[item] for item in items] if type(items) is list else None


def singletons(items: list[Any]) -> list[list[Any]]:
    """``[[item] for item in items]``: fresh one-item lists."""
    made = _C.singletons(items) if _C is not None else None
    return made if made is not None else [[item] for item in items]


if __name__ == "__main__":
    print(status())
