"""The optional C speedups (protocol/_speedups*.c) against their Python references:
the build, the packers, the step's lists and forecasts (the plain step's frames:
test_speedups_frame.py; the digest's terms and lane plans: test_speedups_digest.py;
the bitmasks' rows: test_speedups_rows.py; count rows: test_speedups_counts.py; settles:
test_speedups_absorb.py).

Every C function must return exactly what its reference returns for the inputs it
takes, and None (False: a malformed packed array) for the rest, so the Python path
decides.  Hostile bytes are generated too: the unpackers read the network's data.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from protocol import packing
from protocol.errors import MalformedMessage
from protocol.speedups import C

ROOT = Path(__file__).resolve().parent.parent
needs_c = pytest.mark.skipif(C is None, reason="C speedups not built (no C compiler)")

U64 = st.integers(0, (1 << 64) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
#: what a list handed to the packers may hold: ints of any size and a few impostors
ITEMS = st.one_of(U64, I64, st.integers(-(1 << 70), 1 << 70), st.booleans(),
                  st.floats(allow_nan=False), st.none())


def test_ci_builds_the_speedups() -> None:
    """CI installs with a C compiler, so the C paths are the ones its tests exercise."""
    if os.environ.get("CI") == "true" and os.environ.get("DELTACAST_PURE_PYTHON") != "1":
        assert C is not None, "setup.py did not build protocol._speedups"


def _pure_pack(values: list[object]) -> bytes | None:
    """What pack_uints makes of ``values`` without the speedups (None: C must refuse them
    -- an item that is not an exact int in [0, 2**64) -- so Python decides)."""
    if not all(type(v) is int and 0 <= v < 1 << 64 for v in values):  # type: ignore[operator]
        return None
    if len(values) <= packing.PACK_SMALL:
        return packing._pack_list(values)  # type: ignore[arg-type]
    return packing.pack_uints(np.array(values, dtype=np.uint64))  # the numpy path


def _zigzag(values: list[int]) -> list[int]:
    return [v << 1 if v >= 0 else (-v << 1) - 1 for v in values]


LONG = st.lists(st.integers(0, 5000), min_size=120, max_size=600)


@needs_c
@given(st.one_of(st.lists(U64, max_size=200), st.lists(st.integers(0, 300), max_size=200),
                 LONG, st.lists(ITEMS, max_size=8)))
def test_pack_list_matches_the_reference(values: list[object]) -> None:
    assert C is not None
    assert C.pack_list(values) == _pure_pack(values)


@needs_c
def test_pack_list_refuses_what_is_not_a_list() -> None:
    assert C is not None
    assert C.pack_list((1, 2)) is None
    assert C.pack_list(bytearray(b"\x01")) is None
    assert C.pack_list([1 << 64]) is None


@needs_c
@given(st.one_of(st.lists(I64, max_size=200), st.lists(st.integers(-40, 40), max_size=300),
                 st.lists(ITEMS, max_size=8)))
def test_pack_signed_list_matches_the_reference(values: list[object]) -> None:
    assert C is not None
    taken = all(type(v) is int and -(1 << 63) <= v < 1 << 63 for v in values)  # type: ignore[operator]
    expected = _pure_pack(_zigzag(values)) if taken else None  # type: ignore[arg-type]
    assert C.pack_signed_list(values) == expected


def _pure_raw(buf: bytes, limit: int = 1 << 26) -> list[int] | None:
    """The raw values unpack_uint_list reads from ``buf`` without the speedups (before its
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
    buf = bytearray(C.pack_list(values) if C is not None else b"")
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
    assert C is not None
    expected = _pure_raw(buf)
    assert C.raw_list(buf) == expected
    assert C.raw_list(memoryview(buf)) == expected
    signed = C.raw_signed_list(buf)
    if expected is None:
        assert signed is None
    else:
        assert signed == [v >> 1 if not v & 1 else -(v >> 1) - 1 for v in expected]
    fits = expected is not None and max(expected, default=0) < 1 << 63
    assert C.raw_list_minus_one(buf) == ([v - 1 for v in expected] if fits else None)  # type: ignore[union-attr]


@needs_c
@given(st.one_of(st.lists(st.integers(-1, (1 << 63) - 2), max_size=130),
                 st.lists(st.integers(-1, 600), max_size=300), st.lists(ITEMS, max_size=8)))
@example([(1 << 63) - 1])  # plus one leaves int64
@example([-2])
def test_draft_tokens_pack_plus_one_and_back(values: list[object]) -> None:
    """Draft tokens travel as token + 1: C agrees with ``pack_uints`` of the shifted list,
    refuses what the reference would not take, and unpacking gives the tokens back."""
    assert C is not None
    taken = all(type(v) is int and -1 <= v < (1 << 63) - 1 for v in values)  # type: ignore[operator]
    packed = C.pack_plus_one(values)
    assert packed == (_pure_pack([v + 1 for v in values]) if taken else None)  # type: ignore[operator]
    if taken:
        assert packing.pack_uints_plus_one(values) == packed  # type: ignore[arg-type]
        assert packing.unpack_uint_list_minus_one(packed) == values


@needs_c
@given(st.lists(st.integers(0, 5), max_size=40), st.data())
def test_split_rows_matches_the_reference(lengths: list[int], data: st.DataObject) -> None:
    from engine_side.vllm.convert import split_rows_py

    assert C is not None
    keys = [f"r{i}" for i in range(len(lengths))]
    flat = list(range(sum(lengths)))
    got = C.split_rows(keys, lengths, flat)
    assert got == split_rows_py(keys, lengths, flat)
    assert all(got[k] is not flat for k in got)
    bad = data.draw(st.sampled_from(["short", "long", "negative", "not int", "unhashable"]))
    if bad == "short":
        assert C.split_rows(keys, lengths, flat[:-1]) is None or not flat
    elif bad == "long":
        assert C.split_rows(keys, lengths, [*flat, 9]) is None
    elif bad == "negative" and lengths:
        assert C.split_rows(keys, [-1, *lengths[1:]], flat) is None
    elif bad == "not int" and lengths:
        assert C.split_rows(keys, [1.0, *lengths[1:]], flat) is None
    elif bad == "unhashable" and lengths and lengths[0]:
        assert C.split_rows([[], *keys[1:]], lengths, flat) is None
    assert C.split_rows(tuple(keys), lengths, flat) is None
    assert C.split_rows(keys, lengths + [1], flat) is None


@needs_c
@given(st.lists(st.integers(0, 99), min_size=65, max_size=300), st.integers(0, 400))
def test_raw_list_keeps_the_count_limit(values: list[int], limit: int) -> None:
    assert C is not None
    buf = packing.pack_uints(values)
    assert C.raw_list(buf, limit) == (values if len(values) <= limit else None)
    if len(values) > limit:
        with pytest.raises(MalformedMessage, match="out of bounds"):
            packing.unpack_uint_list(buf, limit=limit)


@needs_c
@given(st.one_of(st.lists(st.integers(0, (1 << 63) - 1), max_size=200),
                 st.lists(st.integers(0, 150_000), max_size=700), LONG,
                 st.lists(st.integers(-3, 300), min_size=1, max_size=300)))
def test_pack_array_matches_the_reference(values: list[int]) -> None:
    """A prompt or table as int64 numpy: the bytes of the numpy path, None for a negative."""
    assert C is not None
    arr = np.array(values, dtype=np.int64)
    expected = None if min(values, default=0) < 0 else _pure_pack(values)  # type: ignore[arg-type]
    assert C.pack_array(arr) == expected
    if expected is not None:  # the public packer, whichever path it takes
        assert packing.pack_uints(arr) == expected
        if max(values, default=0) < 1 << 31:  # a narrower dtype: converted, the same bytes
            assert packing.pack_uints(arr.astype(np.int32)) == expected


@needs_c
def test_pack_array_refuses_what_is_not_a_contiguous_int64_buffer() -> None:
    assert C is not None
    a = np.arange(300, dtype=np.int64)
    assert C.pack_array(a[::2]) is None  # not contiguous
    assert C.pack_array(a.astype(np.int32)) is None
    assert C.pack_array(a.astype(np.float64)) is None
    assert C.pack_array([1, 2]) is None
    assert C.pack_array(b"\x01" * 8) is None  # bytes: format B
    assert packing.pack_uints(a[::2]) == _pure_pack(list(range(0, 300, 2)))  # (Python's path)


@needs_c
@given(packed_or_hostile(), st.integers(0, 1 << 26))
@example(b"\x40\x01" + b"\xff" * 8, 1 << 26)  # a value past int64
@example(b"\x00\x80\x00", 1 << 26)
def test_unpack_array_matches_the_reference_on_any_bytes(buf: bytes, limit: int) -> None:
    """Native int64 bytes of what unpack_uints reads; None where it raises."""
    assert C is not None
    try:
        reference: list[int] | None = packing._unpack_raw(buf, limit).tolist()
    except MalformedMessage:
        reference = None
    if reference is not None and max(reference, default=0) >= 1 << 63:
        reference = None  # past int64: unpack_uints raises
    got = C.unpack_array(buf, limit)
    assert (None if got is None else np.frombuffer(got, dtype=np.int64).tolist()) == reference


@needs_c
@given(st.one_of(st.lists(I64, max_size=300), st.lists(ITEMS, max_size=8)))
def test_int64_bytes_are_numpys_int64_array(values: list[object]) -> None:
    """A prompt list as native int64 bytes; None for anything numpy would convert or
    refuse otherwise (the public helper then calls numpy itself)."""
    assert C is not None
    taken = all(type(v) is int and -(1 << 63) <= v < 1 << 63 for v in values)  # type: ignore[operator]
    got = C.int64_bytes(values)
    if not taken:
        assert got is None
        return
    assert got is not None
    assert np.frombuffer(got, dtype=np.int64).tolist() == values
    assert packing.int64_array(values).tolist() == values  # type: ignore[arg-type]
    assert C.int64_bytes(tuple(values)) is None


@needs_c
def test_unpackers_refuse_what_is_not_a_buffer() -> None:
    assert C is not None
    assert C.raw_list("ab") is None
    assert C.raw_signed_list(12) is None


def test_public_packers_take_the_same_inputs_either_way() -> None:
    """Refusals go through the Python path: the same errors as without the speedups."""
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
import sys
from protocol import digest as dg, packing
from protocol.speedups import C
out = [C is None]
for v in {_SAMPLES}:
    b = packing.pack_uints(v)
    out += [b.hex(), packing.unpack_uint_list(b) if max(v, default=0) < 2**63 else None]
for v in [[-1, 0, 1], [-(2**63), 2**63 - 1], list(range(-600, 600))]:
    b = packing.pack_sints(v)
    out += [b.hex(), packing.unpack_sint_list(b)]
out.append(dg.block_unit_terms([1, 2, 2**40], 3, [0, 7, 9], [5, 2**31, 1]))
print(repr(out))
"""


def _run(pure: bool) -> list[object]:
    env = {**os.environ, "DELTACAST_PURE_PYTHON": "1" if pure else "0"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    return eval(done.stdout)  # type: ignore[no-any-return]  # noqa: S307 - our own repr


def test_bytes_and_terms_do_not_depend_on_the_speedups() -> None:
    """The pure-Python process and the default one agree on every byte and term."""
    pure, default = _run(pure=True), _run(pure=False)
    built = importlib.util.find_spec("protocol._speedups") is not None
    assert pure[0] is True and default[0] is not built
    assert pure[1:] == default[1:]


I64_SMALL = st.integers(-(1 << 40), 1 << 40)


@needs_c
@given(st.data())
def test_forecast_rows_match_the_python_rows(data: st.DataObject) -> None:
    """forecast_rows is the Forecast's Python row, k times over: computed advanced by
    j * nsched, outputs clamped at 0 -- fresh lists of exact ints."""
    assert C is not None
    n, k = data.draw(st.integers(0, 40)), data.draw(st.integers(1, 64))
    base, nsched, plm1 = (data.draw(st.lists(I64_SMALL, min_size=n, max_size=n))
                          for _ in range(3))
    comp_rows, out_rows = C.forecast_rows(base, nsched, plm1, k)
    want = [[b + j * s for b, s in zip(base, nsched, strict=True)] for j in range(1, k + 1)]
    assert comp_rows == want
    assert out_rows == [[max(c - p, 0) for c, p in zip(row, plm1, strict=True)] for row in want]
    assert all(type(v) is int for row in comp_rows + out_rows for v in row)
    assert len({id(row) for row in comp_rows + out_rows}) == 2 * k


@needs_c
@given(st.data())
def test_pack_appends_match_the_python_packing(data: st.DataObject) -> None:
    """pack_appends is QuickEncoder._one_group_rows' three packings: the handles at the
    positions, the counts (b"" when all are 1) and the ids; None for a position
    outside the handles or a value pack_uints would refuse."""
    assert C is not None
    handles = data.draw(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=20))
    pos = data.draw(st.lists(st.integers(0, len(handles) - 1 + data.draw(st.integers(0, 1))),
                             min_size=1, max_size=8))
    counts = data.draw(st.lists(st.integers(1, 4) | st.just(1), min_size=len(pos),
                                max_size=len(pos)))
    ids = data.draw(st.lists(st.integers(0, 1 << 31) | st.just(-1), max_size=sum(counts)))
    got = C.pack_appends(pos, counts, ids, handles)
    if max(pos) >= len(handles) or min(ids, default=0) < 0:
        assert got is None
        return
    assert got == (packing.pack_uints([handles[p] for p in pos]),
                   packing.pack_row_counts(counts), packing.pack_uints(ids))


@needs_c
def test_forecast_rows_refuse_what_they_cannot_make() -> None:
    assert C is not None
    top = (1 << 63) - 1
    assert C.forecast_rows([1], [1, 2], [0], 1) is None  # lengths differ
    assert C.forecast_rows((1,), [1], [0], 1) is None  # not a list
    assert C.forecast_rows([1], [1], [0], 0) is None  # no rows
    assert C.forecast_rows([1], [1], [0], 65) is None  # too many rows
    assert C.forecast_rows([True], [1], [0], 1) is None  # not an exact int
    assert C.forecast_rows([top - 4], [2], [0], 2) == ([[top - 2], [top]], [[top - 2], [top]])
    assert C.forecast_rows([top - 4], [2], [0], 3) is None  # the last row overflows
    assert C.forecast_rows([-top], [0], [top], 1) is None  # an output overflows
    assert C.forecast_rows([0], [1 << 62], [0], 4) is None  # the step times k overflows


#: entries of a one-group new_block_ids list: the shapes vLLM sends and impostors
ENTRIES = st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=1, max_size=3).map(
    lambda ids: (ids,)), st.lists(st.integers(0, 9), min_size=1, max_size=3).map(
    lambda ids: [ids]), st.sampled_from([(), ([],), ([1], [2]), 0, ((1,),), [[]], ([1],) * 2]))


@needs_c
@given(st.lists(ENTRIES, max_size=12))
def test_one_group_appends_match_the_python_path(entries: list[object]) -> None:
    assert C is not None
    plain = all(e is None or (type(e) in (tuple, list) and len(e) == 1  # type: ignore[arg-type]
                              and type(e[0]) is list and e[0])  # type: ignore[index]
                for e in entries)
    got = C.one_group_appends(entries)
    if not plain:
        assert got is None
        return
    grown = [i for i, e in enumerate(entries) if e is not None]
    rows = [entries[i][0] for i in grown]  # type: ignore[index]
    assert got == (grown, [len(r) for r in rows], [v for r in rows for v in r])


ROWS = st.lists(st.one_of(st.lists(st.integers(), min_size=1, max_size=1),
                         st.lists(st.integers(), max_size=3),
                         st.tuples(st.integers()), st.integers()), max_size=12)


@needs_c
@given(ROWS)
def test_single_items_is_its_reference(rows: list[object]) -> None:
    """A list of one-item lists gives its items; anything else None, like the reference."""
    from engine_side.vllm.convert import single_items_py

    assert C is not None
    assert C.single_items(rows) == single_items_py(rows)
    items = C.single_items(rows)
    if items is not None:
        assert items == [r[0] for r in rows]  # type: ignore[index]
    assert C.single_items(tuple(rows)) is None and single_items_py(tuple(rows)) is None


@needs_c
@given(st.lists(st.one_of(st.integers(), st.text(max_size=3), st.none()), max_size=12))
def test_singletons_are_fresh_one_item_lists(items: list[object]) -> None:
    assert C is not None
    made = C.singletons(items)
    assert made == [[item] for item in items]
    assert made is not None and len({id(row) for row in made}) == len(made)  # all distinct
    assert C.singletons(tuple(items)) is None


KEYS = st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), unique=True, max_size=5)


@needs_c
@given(KEYS, KEYS, st.lists(st.integers(0, 2), max_size=6), st.lists(st.integers(0, 2),
                                                                     max_size=6))
def test_dict_matches_is_the_list_comparisons(keys: list[str], other: list[str],
                                              values: list[int], want: list[int]) -> None:
    assert C is not None
    d = dict(zip(keys, values + [0] * len(keys), strict=False))
    for names in (keys, other):
        got = C.dict_matches(d, names, want)
        expected = 0 if list(d) != names else 2 if list(d.values()) == want else 1
        assert got == expected


@needs_c
def test_dict_matches_refuses_what_it_cannot_take() -> None:
    from collections import OrderedDict

    assert C is not None
    assert C.dict_matches(OrderedDict(a=1), ["a"], [1]) is None  # its own order
    assert C.dict_matches({"a": 1}, ("a",), [1]) is None
    assert C.dict_matches({"a": 1}, ["a"], [1]) == 2
    assert C.dict_matches({"a": 1}, ["a"], [1.0]) == 2  # == as Python compares


@needs_c
@given(st.lists(st.tuples(st.integers(0, 9), st.lists(st.integers(-1, 500), max_size=4)),
                max_size=8),
       st.sampled_from(["dict", "unknown key", "tuple row", "n small", "bool position"]))
def test_draft_rows_matches_the_reference(entries: list[tuple[int, list[int]]], twist: str) -> None:
    """Draft tokens by batch position: C takes exactly the dicts the reference takes
    (non-empty lists, known keys, strictly increasing positions below n)."""
    from engine_side.vllm.convert import draft_rows_py

    assert C is not None
    pos: dict[str, Any] = {f"r{i}": i for i in range(10)}
    drafts: dict[str, Any] = {f"r{p}": row for p, row in entries}
    n = 10
    if twist == "unknown key" and drafts:
        drafts["nope"] = [1]
    elif twist == "tuple row" and drafts:
        drafts[next(iter(drafts))] = (1,)
    elif twist == "n small":
        n = 3
    elif twist == "bool position":
        pos["r1"] = True
    want = draft_rows_py(drafts, pos, n)
    assert C.draft_rows(drafts, pos, n) == want
    if want is not None:
        lengths, flat = want
        assert sum(lengths) == len(flat) and len(lengths) == n
