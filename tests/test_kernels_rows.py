"""The C kernels' row scans of integer arrays (protocol/_kernels_rows.c) against their
pure-Python references (protocol/bitmask.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import kernels
from protocol.bitmask import row_rebuild_py, row_refs_py, scan_py
from protocol.errors import MalformedMessage

C = kernels._C  # the built module (None: not built, or DELTACAST_PURE_PYTHON=1)
needs_c = pytest.mark.skipif(C is None, reason="C kernels not in use")


@st.composite
def _word_rows(draw: st.DrawFn) -> np.ndarray:
    """Rows of words of every width, mostly all-zero or all-one words (and ties)."""
    dtype = np.dtype(draw(st.sampled_from([np.uint8, np.int16, np.int32, np.uint32,
                                           np.int64])))
    rows, words = draw(st.integers(1, 12)), draw(st.integers(0, 24))
    pick = st.sampled_from([0, -1, -1, 0, 5, 1 << 6]) if dtype.kind == "i" \
        else st.sampled_from([0, int(np.iinfo(dtype).max), 7])
    cells = draw(st.lists(pick, min_size=rows * words, max_size=rows * words))
    return np.array(cells, dtype=np.int64).astype(dtype).reshape(rows, words)


@needs_c
@given(_word_rows())
def test_sparse_scan_matches_the_reference(rows: np.ndarray) -> None:
    assert C is not None
    assert C.sparse_scan(rows, rows.shape[0], rows.itemsize) == scan_py(rows)


@needs_c
def test_sparse_scan_refuses_what_it_cannot_take() -> None:
    assert C is not None
    words = np.zeros((4, 6), np.int32)
    assert C.sparse_scan(words, 0, 4) is None  # no rows
    assert C.sparse_scan(words, -1, 4) is None
    assert C.sparse_scan(words, 5, 4) is None  # 24 words in 5 rows
    assert C.sparse_scan(words, 4, 3) is None  # no such word size
    assert C.sparse_scan(bytes(10), 1, 4) is None  # not whole words
    assert C.sparse_scan(words[:, ::2], 4, 4) is None  # not contiguous
    assert C.sparse_scan(memoryview(bytes(17))[1:], 1, 8) is None  # not aligned
    assert C.sparse_scan([0, 0], 1, 4) is None  # not a buffer
    assert C.sparse_scan(words, "4", 4) is None  # type: ignore[arg-type]


@st.composite
def _row_buffers(draw: st.DrawFn) -> tuple[bytes, bytes, int]:
    """(table, rows, width): whole rows drawn from a small pool, so rows repeat within
    and across the two (a pool row may differ from another in one byte only).  Rows
    over 64 words are hashed by sampled words first (``row_sample_hash``)."""
    width = draw(st.one_of(st.integers(1, 70), st.integers(513, 1100)))
    base = draw(st.binary(min_size=width, max_size=width))
    pool = [base] + [bytes(b ^ (i == j) for i, b in enumerate(base))
                     for j in draw(st.lists(st.integers(0, width - 1), max_size=4))]
    pool += draw(st.lists(st.binary(min_size=width, max_size=width), max_size=3))
    pick = st.sampled_from(pool)
    table = b"".join(draw(st.lists(pick, max_size=6)))
    return table, b"".join(draw(st.lists(pick, max_size=12))), width


@needs_c
@given(_row_buffers())
def test_row_refs_matches_the_reference(case: tuple[bytes, bytes, int]) -> None:
    assert C is not None
    table, rows, width = case
    assert C.row_refs(table, rows, width) == row_refs_py(table, rows, width)


@needs_c
def test_row_refs_of_rows_alike_at_every_sampled_word() -> None:
    """Rows that differ only between the words the first pass samples all hash alike
    there; past its collision limit every byte is hashed, and the answer is still the
    reference's."""
    assert C is not None
    width = 4096  # 512 words: the first pass samples every eighth, and the last
    distinct = []
    for i in range(40):
        row = bytearray(width)
        row[9] = i + 1  # (in word 1, which is not sampled)
        distinct.append(bytes(row))
    table = b"".join(distinct[:5])
    rows = b"".join(distinct[k % 40] for k in (3, 7, 3, 39, 12, 7, 0, 25, 39) + tuple(range(40)))
    got = C.row_refs(table, rows, width)
    assert got == row_refs_py(table, rows, width)
    refs = got[0]
    assert refs[0] == refs[2] == 3 and refs[1] == refs[5] and refs[3] == refs[8]


@needs_c
@given(_row_buffers(), st.lists(st.integers(-2, 20), max_size=12), st.booleans())
def test_row_rebuild_matches_the_reference(case: tuple[bytes, bytes, int], refs: list[int],
                                           from_encoder: bool) -> None:
    """Valid references (an encoder's) rebuild the rows and the next table; any others
    are None in C and MalformedMessage in Python."""
    assert C is not None
    table, fresh, width = case
    if from_encoder:  # what a decoder gets: the encoder's refs and fresh rows
        rows = fresh
        refs, fresh, next_table = row_refs_py(table, rows, width)
        assert C.row_rebuild(table, fresh, refs, width) == (bytearray(rows), next_table)
    got = C.row_rebuild(table, fresh, refs, width)
    try:
        want = row_rebuild_py(table, fresh, refs, width)
    except MalformedMessage:
        assert got is None
    else:
        assert got == want


@needs_c
def test_row_functions_refuse_what_they_cannot_take() -> None:
    assert C is not None
    assert C.row_refs(b"", b"abc", 2) is None  # not whole rows
    assert C.row_refs(b"a", b"ab", 2) is None
    assert C.row_refs(b"", b"ab", 0) is None
    assert C.row_refs([1], b"ab", 2) is None  # not a buffer
    assert C.row_rebuild(b"", b"ab", (0,), 2) is None  # not a list
    assert C.row_rebuild(b"", b"ab", [True], 2) is None  # not an exact int
    assert C.row_rebuild(b"", b"ab", [1 << 70], 2) is None
    assert C.row_rebuild(b"", b"abc", [0], 2) is None
    assert C.row_rebuild(b"", b"abcd", [1, 0], 2) is None  # fresh rows out of order
    assert C.row_rebuild(b"", b"abcd", [0, 0], 2) is None  # a fresh row never used
    assert C.row_rebuild(b"", b"ab", [0, 0], 2) == (bytearray(b"abab"), b"ab")
