"""Packed integer arrays (grammar bitmasks): deflated and sparse words are exact, and
hostile input is refused."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.bitmask import (
    MAX_INFLATED,
    Deflated,
    SparseWords,
    deflate_sparse,
    expand,
    inflate,
    sparse_words,
)
from protocol.errors import MalformedMessage
from protocol.packing import pack_uints

_INT_TYPES = st.sampled_from([np.int32, np.int64, np.uint8, np.uint32, np.int16])


@given(hnp.arrays(st.sampled_from([np.int32, np.int64, np.uint8]),
                  hnp.array_shapes(min_dims=1, max_dims=3, max_side=64),
                  elements=st.sampled_from([0, 1, 7])))
def test_deflate_round_trips_exactly(a: np.ndarray) -> None:
    d = deflate_sparse(a, min_bytes=0)
    if d is None:  # deflating did not halve it
        assert len(zlib.compress(a.tobytes(), 1)) * 2 > a.nbytes
        return
    b = inflate(d)
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)


def test_only_integer_arrays_worth_it_are_deflated() -> None:
    assert deflate_sparse(np.zeros(1024, np.float32)) is None
    assert deflate_sparse(np.zeros(8, np.int32)) is None  # under min_bytes
    rng = np.random.default_rng(0)
    assert deflate_sparse(rng.integers(-2**31, 2**31 - 1, 4096, dtype=np.int32)) is None
    assert deflate_sparse(np.zeros(4096, np.int32)) is not None


@pytest.mark.parametrize("bad", [
    Deflated("<i4", (4,), b"not zlib"),
    Deflated("<i4", (4,), zlib.compress(bytes(12))),          # too short
    Deflated("<i4", (4,), zlib.compress(bytes(20))),          # too long
    Deflated("<f4", (4,), zlib.compress(bytes(16))),          # not integers
    Deflated("zz", (4,), zlib.compress(bytes(16))),           # no dtype
    Deflated("<i4", (-4,), zlib.compress(bytes(16))),
    Deflated("<u1", (MAX_INFLATED + 1,), zlib.compress(bytes(1 << 20))),  # claims too much
])
def test_hostile_deflated_arrays_are_malformed(bad: Deflated) -> None:
    with pytest.raises(MalformedMessage):
        inflate(bad)


@st.composite
def _bitmask_like(draw: st.DrawFn) -> np.ndarray:
    """Rows of all-zero or all-one words with a few other words."""
    dtype: Any = np.dtype(draw(_INT_TYPES))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, max_side=40))
    info = np.iinfo(dtype)
    a = np.zeros(shape, dtype)
    rows = a.reshape(shape[0] if a.ndim > 1 else 1, -1)
    for r in range(rows.shape[0]):
        if draw(st.booleans()):
            rows[r] = ~np.zeros((), dtype)
        for _ in range(draw(st.integers(0, 4))):
            at = draw(st.integers(0, rows.shape[1] - 1))
            rows[r, at] = draw(st.integers(int(info.min), int(info.max)))
    return a


@given(st.one_of(_bitmask_like(), hnp.arrays(_INT_TYPES, hnp.array_shapes(max_side=16))))
def test_sparse_words_round_trip_exactly(a: np.ndarray) -> None:
    w = sparse_words(a)
    if w is None:  # empty, or the words that differ from their rows' background are too many
        rows = a.reshape(a.shape[0] if a.ndim > 1 else 1, -1)
        ones = rows == ~np.zeros((), a.dtype)
        differ = [int((~o).sum()) if o.sum() * 2 > o.size else int((r != 0).sum())
                  for o, r in zip(ones, rows, strict=True)]
        assert a.size == 0 or 2 * sum(differ) * a.itemsize > a.nbytes
        return
    assert len(w.values) * 2 <= a.nbytes
    b = expand(w)
    assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
    assert b.flags.writeable  # a fresh array, like pickle's


def test_a_real_vocabulary_bitmask_shrinks_to_its_exceptions() -> None:
    words = 128256 // 32 + 1  # Llama 3's vocabulary
    mask = np.zeros((64, words), np.int32)
    mask[::2] = -1  # half the rows allow almost everything, half almost nothing
    mask[:, 100:103] = 0x0F0F0F0F
    w = sparse_words(mask)
    assert w is not None and len(w.values) == 64 * 3 * 4
    assert len(w.gaps) + len(w.background) < 400
    assert np.array_equal(expand(w), mask)


def test_only_integer_arrays_worth_it_are_sparse() -> None:
    assert sparse_words(np.zeros(1024, np.float32)) is None
    assert sparse_words(np.zeros(0, np.int32)) is None
    assert sparse_words(np.arange(1, 1025, dtype=np.int32)) is None  # every word differs


_ONE_ROW = (pack_uints([0]), pack_uints([0, 1]), bytes(8))  # background, gaps, two words


@pytest.mark.parametrize("bad", [
    SparseWords("<f4", (4,), *_ONE_ROW),                          # not integers
    SparseWords("zz", (4,), *_ONE_ROW),                           # no dtype
    SparseWords("<i4", (-4,), *_ONE_ROW),                         # negative dimension
    SparseWords("<u1", (MAX_INFLATED + 1,), *_ONE_ROW),           # claims too much
    SparseWords("<i4", (), *_ONE_ROW),                            # no dimension
    SparseWords("<i4", (2, 4), *_ONE_ROW),                        # one background for two rows
    SparseWords("<i4", (4,), pack_uints([2]), *_ONE_ROW[1:]),     # background neither 0 nor 1
    SparseWords("<i4", (4,), _ONE_ROW[0], pack_uints([0]), bytes(8)),  # 1 gap, 2 words
    SparseWords("<i4", (4,), _ONE_ROW[0], pack_uints([0, 9]), bytes(8)),  # gap past the end
    SparseWords("<i4", (4,), _ONE_ROW[0], pack_uints([2, 1]), bytes(8)),  # position 4 of 4
    SparseWords("<i4", (4,), b"\x09", *_ONE_ROW[1:]),             # truncated packed array
])
def test_hostile_sparse_words_are_malformed(bad: SparseWords) -> None:
    with pytest.raises(MalformedMessage):
        expand(bad)


@pytest.mark.parametrize("name", ["a", "S4", "<f4", "i4,i4", "<U9999999999", "int32", "", "|b1"])
def test_a_dtype_string_outside_the_integer_list_is_malformed(name: str) -> None:
    """Only ``|i1``, ``|u1``, ``<i2`` .. ``>u8`` (SPEC): numpy's parser never sees the
    peer's text (it warns, raises other errors, or builds non-integer types)."""
    with pytest.raises(MalformedMessage, match="bad dtype"):
        inflate(Deflated(name, (4,), zlib.compress(bytes(4))))


def test_every_listed_dtype_string_is_an_integer_type() -> None:
    for name in ["|i1", "|u1", "<i2", ">u8", "<u4", ">i8"]:
        a = np.arange(3, dtype=name)
        assert np.array_equal(inflate(Deflated(name, (3,), zlib.compress(a.tobytes()))), a)
