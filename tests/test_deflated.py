"""Deflated integer arrays (sparse grammar bitmasks): exact, and hostile input refused."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine_side.vllm.schema import MAX_INFLATED, Deflated, deflate_sparse, inflate
from protocol.errors import MalformedMessage


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
