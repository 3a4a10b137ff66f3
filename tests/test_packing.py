"""Bit-packed integer arrays (protocol.packing): round-trips at every width, bad buffers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import MalformedMessage
from protocol.packing import (
    pack_sints,
    pack_uints,
    unpack_sint_list,
    unpack_sints,
    unpack_uint_list,
    unpack_uints,
)


@st.composite
def uints_of_width(draw: st.DrawFn) -> tuple[int, list[int]]:
    """(width, values) where the largest value needs exactly ``width`` bits."""
    width = draw(st.integers(0, 64))
    top = (1 << width) - 1
    values = draw(st.lists(st.integers(0, top), max_size=40))
    if width:
        values.insert(draw(st.integers(0, len(values))), top >> 1 | 1 << (width - 1))
    return width, values


@given(uints_of_width())
def test_uints_roundtrip_at_every_width(case: tuple[int, list[int]]) -> None:
    width, values = case
    buf = pack_uints(np.array(values, dtype=np.uint64))
    assert buf[0] == width  # minimal common width
    header = 1 + (1 if len(values) < 128 else 2)
    assert len(buf) == header + (len(values) * width + 7) // 8  # no slack bytes
    if values and max(values) >= 2**63:  # does not fit the int64 result: refused, never wrapped
        with pytest.raises(MalformedMessage):
            unpack_uints(buf)
        return
    out = unpack_uints(buf)
    assert out.dtype == np.int64 and out.flags.writeable
    assert out.tolist() == values


@given(st.integers(0, 64).flatmap(
    lambda w: st.lists(st.integers(0, (1 << w) - 1), max_size=300)))
def test_python_list_paths_equal_the_numpy_paths(values: list[int]) -> None:
    """Short lists take Python-int paths (packing.SMALL, PACK_SMALL): the same bytes."""
    buf = pack_uints(values)
    assert buf == pack_uints(np.array(values, dtype=np.uint64))
    if not values or max(values) < 2**63:
        assert unpack_uint_list(buf) == unpack_uints(buf).tolist() == values
    signed = [v - (1 << 62) for v in values if v < 2**63]
    assert pack_sints(signed) == pack_sints(np.array(signed, dtype=np.int64))
    assert unpack_sint_list(pack_sints(signed)) == signed


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40))
def test_sints_roundtrip(values: list[int]) -> None:
    assert unpack_sints(pack_sints(values)).tolist() == values


@pytest.mark.parametrize("value", [0, 1, -1, 63, -64, 64, 2**62, -(2**63), 2**63 - 1])
def test_sints_zigzag_width(value: int) -> None:
    zigzag = (value << 1) ^ (value >> 63)
    assert pack_sints([value])[0] == (zigzag & (2**64 - 1)).bit_length()


def test_negative_values_need_pack_sints() -> None:
    with pytest.raises(ValueError, match="pack_sints"):
        pack_uints([3, -1])


@given(uints_of_width(), st.data())
def test_truncated_buffer_is_malformed(case: tuple[int, list[int]], data: st.DataObject) -> None:
    buf = pack_uints(np.array(case[1], dtype=np.uint64))
    cut = data.draw(st.integers(0, len(buf) - 1), label="cut")
    with pytest.raises(MalformedMessage):
        unpack_uints(buf[:cut])


@given(uints_of_width(), st.binary(min_size=1, max_size=8))
def test_overlong_buffer_is_malformed(case: tuple[int, list[int]], extra: bytes) -> None:
    with pytest.raises(MalformedMessage):
        unpack_uints(pack_uints(np.array(case[1], dtype=np.uint64)) + extra)


@pytest.mark.parametrize(
    "buf",
    [
        b"",  # no width byte
        b"\x41\x01" + b"\0" * 9,  # width 65
        b"\x08" + b"\xff" * 10 + b"\x01",  # count varint longer than 64 bits
        b"\x01\x80\x80\x80\x80\x01",  # count 2**28 over the allocation limit
        b"\x00\x03\x00",  # zero width carries no payload
    ],
)
def test_bad_headers_are_malformed(buf: bytes) -> None:
    with pytest.raises(MalformedMessage):
        unpack_uints(buf)
