"""The C ``absorb_rows`` (protocol/_speedups_absorb.c) against its reference,
``protocol.columns.absorb_rows_py``: journaled block appends written into a block table,
its lengths and block sums.  Where C takes the rows the arrays end alike; where it does
not it writes nothing (the reference then grows the table, or raises)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.columns import BlockTable, absorb_rows_py
from protocol.speedups import C

needs_c = pytest.mark.skipif(C is None, reason="C speedups not built")
Entry = tuple[list[int], list[int], list[int], list[int], list[int]]


@st.composite
def _entries(draw: st.DrawFn) -> list[Entry]:
    """A few journaled steps: rows at handles up to 9 (some past a 6-row table, none
    past the 16 block sums, as a state's columns hold every handle), starts
    up to 6 and 1..3 ids each (some past its 8 columns), ids near int32's edges, terms
    up to 2**64 - 1 (their sums wrap)."""
    out = []
    for _ in range(draw(st.integers(0, 4))):
        rows = draw(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 6), st.integers(1, 3)),
                             min_size=1, max_size=4))
        ids = draw(st.lists(st.sampled_from([0, 5, 2**31 - 1, -(2**31), 123]),
                            min_size=sum(c for _, _, c in rows),
                            max_size=sum(c for _, _, c in rows)))
        terms = draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(rows), max_size=len(rows)))
        out.append(([h for h, _, _ in rows], [s for _, s, _ in rows],
                    [c for _, _, c in rows], ids, terms))
    return out


def _arrays() -> tuple[BlockTable, np.ndarray[Any, Any]]:
    table = BlockTable(capacity=6, width=8)
    table.table[:] = np.arange(48, dtype=np.int32).reshape(6, 8)
    table.lengths[:] = [1, 2, 3, 4, 5, 6]
    return table, np.arange(16, dtype=np.uint64) * np.uint64(2**62)  # (the columns: all handles)


def _same(a: tuple[BlockTable, np.ndarray[Any, Any]],
          b: tuple[BlockTable, np.ndarray[Any, Any]]) -> bool:
    return bool(np.array_equal(a[0].table, b[0].table)
                and np.array_equal(a[0].lengths, b[0].lengths) and np.array_equal(a[1], b[1]))


@needs_c
@given(_entries())
def test_absorb_rows_writes_what_the_reference_writes_or_nothing(entries: list[Entry]) -> None:
    assert C is not None
    ours, reference, before = _arrays(), _arrays(), _arrays()
    table, sums = ours
    taken = C.absorb_rows(table.table, table.lengths, sums, entries)
    fits = all(h < 6 and s + c <= 8 for e in entries for h, s, c in zip(*e[:3], strict=True))
    assert taken is (True if fits else None)
    if not taken:
        assert _same(ours, before)  # nothing written: the reference decides
        absorb_rows_py(*ours, entries)
    absorb_rows_py(*reference, entries)
    assert _same(ours, reference)


@needs_c
@pytest.mark.parametrize("twist", ["int64 table", "2-D sums", "read-only lengths",
                                   "strided sums", "id over int32", "ids short", "ids over",
                                   "negative start", "zero count", "list entry", "bool handle",
                                   "no rows"])
def test_absorb_rows_refuses_and_writes_nothing(twist: str) -> None:
    assert C is not None
    table, sums = _arrays()
    cells, lengths = table.table, table.lengths
    entry: Any = ([1, 2], [0, 1], [1, 2], [7, 8, 9], [3, 4])
    if twist == "int64 table":
        cells = cells.astype(np.int64)
    elif twist == "2-D sums":
        sums = sums.reshape(2, 8)
    elif twist == "read-only lengths":
        lengths = lengths.copy()
        lengths.flags.writeable = False
    elif twist == "strided sums":
        sums = np.zeros(32, dtype=np.uint64)[::2]
    elif twist == "id over int32":
        entry = ([1], [0], [1], [2**31], [3])
    elif twist == "ids short":
        entry = ([1, 2], [0, 1], [1, 2], [7, 8], [3, 4])
    elif twist == "ids over":
        entry = ([1], [0], [1], [7, 8], [3])
    elif twist == "negative start":
        entry = ([1], [-1], [1], [7], [3])
    elif twist == "zero count":
        entry = ([1], [0], [0], [], [3])
    elif twist == "list entry":
        entry = list(entry)
    elif twist == "bool handle":
        entry = ([True], [0], [1], [7], [3])
    elif twist == "no rows":
        entry = ([], [], [], [], [])
    arrays: tuple[np.ndarray, ...] = (cells, lengths, sums)
    snapshot = tuple(a.copy() for a in arrays)
    good = ([0], [0], [1], [99], [1])  # (checked and refused with the other: all or nothing)
    assert C.absorb_rows(cells, lengths, sums, [good, entry]) is None
    for now, was in zip(arrays, snapshot, strict=True):
        assert np.array_equal(now, was)
