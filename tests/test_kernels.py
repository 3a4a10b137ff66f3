"""The optional C kernels (protocol/_kernels*.c) against their pure-Python references:
the build and its typed facade, the packers and the list kernels (the row scans:
test_kernels_rows.py).

Every C function must return exactly what its reference returns for the inputs it
takes, and None for the rest, so the Python path decides.  Hostile bytes are generated
too: the unpackers read the network's data.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from protocol import kernels, packing
from protocol.errors import MalformedMessage

ROOT = Path(__file__).resolve().parent.parent
C = kernels._C  # the built module (None: not built, or DELTACAST_PURE_PYTHON=1)
needs_c = pytest.mark.skipif(C is None, reason="C kernels not in use")
LIMIT = 1 << 26  # the unpackers' default count limit

U64 = st.integers(0, (1 << 64) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
#: what a list handed to the packers may hold: ints of any size and a few impostors
ITEMS = st.one_of(U64, I64, st.integers(-(1 << 70), 1 << 70), st.booleans(),
                  st.floats(allow_nan=False), st.none())
LONG = st.lists(st.integers(0, 5000), min_size=120, max_size=600)


def test_ci_builds_the_kernels() -> None:
    """CI installs with a C compiler, so the C paths are the ones its tests exercise."""
    if os.environ.get("CI") == "true" and os.environ.get(kernels.PURE_ENV) != "1":
        assert C is not None, "setup.py did not build protocol._kernels"


def _stub_names() -> set[str]:
    tree = ast.parse((ROOT / "protocol" / "_kernels.pyi").read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_the_facade_calls_exactly_the_stubs_functions() -> None:
    """protocol.kernels reaches the module only for the stub's functions, and every one
    of them (a kernel nothing calls goes)."""
    tree = ast.parse((ROOT / "protocol" / "kernels.py").read_text(encoding="utf-8"))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "_C"
            and not node.attr.startswith("__")}
    assert used == _stub_names()


def test_the_built_module_has_exactly_the_stubs_functions() -> None:
    if importlib.util.find_spec("protocol._kernels") is None:
        pytest.skip("C kernels not built (no C compiler)")
    import protocol._kernels as built

    assert {n for n in dir(built) if not n.startswith("_")} == _stub_names()


def test_only_the_facade_imports_the_module() -> None:
    offenders = [path.relative_to(ROOT).as_posix()
                 for package in ("protocol", "engine_side", "worker_side")
                 for path in sorted((ROOT / package).rglob("*.py"))
                 if path.name != "kernels.py" or path.parent.name != "protocol"
                 if "_kernels" in path.read_text(encoding="utf-8")]
    assert not offenders


def _pure_pack(values: list[object]) -> bytes | None:
    """What pack_uints makes of ``values`` without the kernels (None: C must refuse them
    -- an item that is not an exact int in [0, 2**64) -- so Python decides)."""
    if not all(type(v) is int and 0 <= v < 1 << 64 for v in values):  # type: ignore[operator]
        return None
    if len(values) <= packing.PACK_SMALL:
        return packing._pack_list(values)  # type: ignore[arg-type]
    return packing.pack_uints(np.array(values, dtype=np.uint64))  # the numpy path


def _zigzag(values: list[int]) -> list[int]:
    return [v << 1 if v >= 0 else (-v << 1) - 1 for v in values]


@needs_c
@given(st.one_of(st.lists(U64, max_size=200), st.lists(st.integers(0, 300), max_size=200),
                 LONG, st.lists(ITEMS, max_size=8)))
def test_pack_list_matches_the_reference(values: list[object]) -> None:
    assert kernels.pack_list(values) == _pure_pack(values)  # type: ignore[arg-type]


@needs_c
def test_pack_list_refuses_what_is_not_a_list() -> None:
    assert C is not None
    assert C.pack_list((1, 2)) is None
    assert C.pack_list(bytearray(b"\x01")) is None
    assert C.pack_list([1 << 64]) is None
    assert C.pack_signed_list((1,)) is None


@needs_c
@given(st.one_of(st.lists(I64, max_size=200), st.lists(st.integers(-40, 40), max_size=300),
                 st.lists(ITEMS, max_size=8)))
def test_pack_signed_list_matches_the_reference(values: list[object]) -> None:
    taken = all(type(v) is int and -(1 << 63) <= v < 1 << 63 for v in values)  # type: ignore[operator]
    expected = _pure_pack(_zigzag(values)) if taken else None  # type: ignore[arg-type]
    assert kernels.pack_signed_list(values) == expected  # type: ignore[arg-type]


def _pure_raw(buf: bytes, limit: int = LIMIT) -> list[int] | None:
    """The raw values unpack_uint_list reads from ``buf`` without the kernels (before its
    int64 check); None where it raises."""
    try:
        short = packing._raw_list_py(buf)
        return short if short is not None else packing._unpack_raw(buf, limit).tolist()
    except MalformedMessage:
        return None


@st.composite
def packed_or_hostile(draw: st.DrawFn) -> bytes:
    """A packed array (short or long), one with a damaged header or length, or random
    bytes."""
    kind = draw(st.sampled_from(["packed", "header", "length", "random"]))
    if kind == "random":
        return draw(st.binary(max_size=80))
    values = draw(st.one_of(st.lists(U64, max_size=70), LONG))
    buf = bytearray(packing.pack_uints(values))
    if kind == "header":
        buf[draw(st.integers(0, min(2, len(buf) - 1)))] = draw(st.integers(0, 255))
    elif kind == "length":
        buf = buf[:-1] if draw(st.booleans()) and len(buf) > 2 else buf + b"\x00"
    return bytes(buf)


@needs_c
@given(packed_or_hostile())
@example(b"")
@example(b"\x08")
@example(b"\x00")
@example(b"\x41\x00")
@example(b"\x00\x80\x00")  # a non-canonical count
@example(b"\x00" + b"\xff" * 9 + b"\x01")  # an overlong count
@example(b"\x08\x41" + bytes(65))
@example(b"\x40\x01" + bytes(8))
def test_raw_list_matches_the_reference_on_any_bytes(buf: bytes) -> None:
    expected = _pure_raw(buf)
    assert kernels.raw_list(buf, LIMIT) == expected
    assert kernels.raw_list(memoryview(buf), LIMIT) == expected  # type: ignore[arg-type]
    signed = kernels.raw_signed_list(buf, LIMIT)
    if expected is None:
        assert signed is None
    else:
        assert signed == [v >> 1 if not v & 1 else -(v >> 1) - 1 for v in expected]


@needs_c
@given(st.lists(st.integers(0, 99), min_size=65, max_size=300), st.integers(0, 400))
def test_raw_list_keeps_the_count_limit(values: list[int], limit: int) -> None:
    buf = packing.pack_uints(values)
    assert kernels.raw_list(buf, limit) == (values if len(values) <= limit else None)
    if len(values) > limit:
        with pytest.raises(MalformedMessage, match="out of bounds"):
            packing.unpack_uint_list(buf, limit=limit)


@needs_c
@given(st.one_of(st.lists(st.integers(0, (1 << 63) - 1), max_size=200),
                 st.lists(st.integers(0, 150_000), max_size=700), LONG,
                 st.lists(st.integers(-3, 300), min_size=1, max_size=300)))
def test_pack_array_matches_the_reference(values: list[int]) -> None:
    """A prompt or table as int64 numpy: the bytes of the numpy path, None for a negative."""
    arr = np.array(values, dtype=np.int64)
    expected = None if min(values, default=0) < 0 else _pure_pack(values)  # type: ignore[arg-type]
    assert kernels.pack_array(arr) == expected
    if expected is not None:  # the public packer, whichever path it takes
        assert packing.pack_uints(arr) == expected
        if max(values, default=0) < 1 << 31:  # a narrower dtype: converted, the same bytes
            assert packing.pack_uints(arr.astype(np.int32)) == expected


@needs_c
def test_pack_array_refuses_what_is_not_a_contiguous_int64_buffer() -> None:
    a = np.arange(300, dtype=np.int64)
    assert kernels.pack_array(a[::2]) is None  # not contiguous
    assert kernels.pack_array(a.astype(np.int32)) is None
    assert kernels.pack_array(a.astype(np.float64)) is None
    assert kernels.pack_array([1, 2]) is None
    assert kernels.pack_array(b"\x01" * 8) is None  # bytes: format B
    assert packing.pack_uints(a[::2]) == _pure_pack(list(range(0, 300, 2)))  # (Python's path)


@needs_c
@given(packed_or_hostile(), st.integers(0, LIMIT))
@example(b"\x40\x01" + b"\xff" * 8, LIMIT)  # a value past int64
@example(b"\x00\x80\x00", LIMIT)
@example(b"\x08\x01\x07", 1 << 60)  # a limit past what C takes
def test_unpack_array_matches_the_reference_on_any_bytes(buf: bytes, limit: int) -> None:
    """Native int64 bytes of what unpack_uints reads; None where it raises."""
    try:
        reference: list[int] | None = packing._unpack_raw(buf, limit).tolist()
    except MalformedMessage:
        reference = None
    if reference is not None and max(reference, default=0) >= 1 << 63:
        reference = None  # past int64: unpack_uints raises
    got = kernels.unpack_array(buf, limit)
    if limit > 1 << 56:
        assert got is None  # (not taken: Python decides)
        return
    assert (None if got is None else np.frombuffer(got, dtype=np.int64).tolist()) == reference


@needs_c
def test_unpackers_refuse_what_is_not_a_buffer() -> None:
    assert C is not None
    assert C.raw_list("ab", LIMIT) is None
    assert C.raw_signed_list(12, LIMIT) is None
    assert C.unpack_array(b"\x00\x00", "x") is None  # type: ignore[arg-type]
    assert C.raw_list(b"\x00\x00", -1) is None  # (read as 2**64 - 1: past what C takes)


def test_public_packers_take_the_same_inputs_either_way() -> None:
    """Refusals go through the Python path: the same errors as without the kernels."""
    with pytest.raises(ValueError, match="non-negative"):
        packing.pack_uints([1, -1])
    with pytest.raises(MalformedMessage, match="length mismatch"):
        packing.unpack_uint_list(b"\x08\x02\x01")
    with pytest.raises(MalformedMessage, match="length mismatch"):
        packing.unpack_sint_list(b"\x08\x02\x01")
    with pytest.raises(MalformedMessage, match="non-canonical"):
        packing.unpack_uint_list(b"\x00\x80\x00")
    with pytest.raises(ValueError, match="non-negative"):
        packing.pack_uints([*range(300), -1])
    assert packing.pack_uints([True, 2]) == packing.pack_uints(packing.np.array([1, 2]))


_SAMPLES = ("[[], [0], [5, 1, 300], list(range(127)), list(range(3000)), [2**64 - 1, 3], "
            "[2**63, 1]]")
_SCRIPT = f"""
from protocol import kernels, packing
out = [kernels.NATIVE]
for v in {_SAMPLES}:
    b = packing.pack_uints(v)
    out += [b.hex(), packing.unpack_uint_list(b) if max(v, default=0) < 2**63 else None]
    out.append(packing.unpack_uints(b).tolist() if max(v, default=0) < 2**63 else None)
for v in [[-1, 0, 1], [-(2**63), 2**63 - 1], list(range(-600, 600))]:
    b = packing.pack_sints(v)
    out += [b.hex(), packing.unpack_sint_list(b)]
out += [kernels.single_items([[1], [2]]), kernels.singletons([3])]
import numpy as np
out.append(kernels.mismatches([1, 2, 2**40], np.array([1, 3, 2**40])))
print(repr(out))
"""


def _run(pure: bool) -> list[object]:
    env = {**os.environ, kernels.PURE_ENV: "1" if pure else "0"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    return eval(done.stdout)  # type: ignore[no-any-return]  # noqa: S307 - our own repr


def test_bytes_do_not_depend_on_the_kernels() -> None:
    """The pure-Python process and the default one agree on every byte and list."""
    pure, default = _run(pure=True), _run(pure=False)
    assert pure[0] is False
    assert default[0] is (importlib.util.find_spec("protocol._kernels") is not None)
    assert pure[1:] == default[1:]


ROWS = st.lists(st.one_of(st.lists(st.integers(), min_size=1, max_size=1),
                         st.lists(st.integers(), max_size=3),
                         st.tuples(st.integers()), st.integers()), max_size=12)


@needs_c
@given(ROWS)
def test_single_items_is_its_reference(rows: list[object]) -> None:
    """A list of one-item lists gives its items; anything else None, like the reference."""
    assert C is not None
    assert C.single_items(rows) == kernels.single_items_py(rows)
    assert C.single_items(tuple(rows)) is None and kernels.single_items_py(tuple(rows)) is None


@needs_c
@given(st.lists(st.one_of(st.integers(), st.text(max_size=3), st.none()), max_size=12))
def test_singletons_are_fresh_one_item_lists(items: list[object]) -> None:
    assert C is not None
    made = C.singletons(items)
    assert made == kernels.singletons_py(items) == kernels.singletons(items)
    assert made is not None and len({id(row) for row in made}) == len(made)  # all distinct
    assert C.singletons(tuple(items)) is None and kernels.singletons_py(tuple(items)) is None


@needs_c
@given(st.lists(st.integers(-(1 << 70), 1 << 70), max_size=40), st.data())
def test_mismatches_are_the_positions_a_list_departs_from_an_array(
        values: list[int], data: st.DataObject) -> None:
    """Exactly the reference's positions for a list of ints beside an int64 array of its
    length; None (the reference decides) for ints past int64, impostors, other lengths
    or other arrays."""
    assert C is not None
    array = np.asarray(data.draw(st.lists(I64, min_size=len(values), max_size=len(values))),
                       dtype=np.int64)
    for p in data.draw(st.lists(st.integers(0, max(len(values) - 1, 0)), max_size=5)):
        if values and -(1 << 63) <= values[p] < 1 << 63:
            array[p] = values[p]  # some equal entries
    wide = any(not -(1 << 63) <= v < 1 << 63 for v in values)
    got = C.mismatches(values, array)
    assert got is None if wide else got == kernels.mismatches_py(values, array)
    assert kernels.mismatches(values, array) == kernels.mismatches_py(values, array)
    assert C.mismatches([*values, 1], array) is None
    assert C.mismatches(tuple(values), array) is None
    assert C.mismatches(values, array.astype(np.int32)) is None
    if values and not wide:
        assert C.mismatches([*values[:-1], float(values[-1])], array) is None
        assert C.mismatches([*values[:-1], True], array) is None


def test_whole_functions_without_the_module() -> None:
    """The references the facade falls back on (the pure-Python process's answers)."""
    assert kernels.single_items_py([[1], [2]]) == [1, 2]
    assert kernels.single_items_py([[1], [2, 3]]) is None
    assert kernels.singletons_py([1, 2]) == [[1], [2]]
    assert kernels.mismatches_py([1, 2, 3], np.array([1, 5, 3])) == [1]
    assert kernels.mismatches_py([], np.zeros(0, dtype=np.int64)) == []
