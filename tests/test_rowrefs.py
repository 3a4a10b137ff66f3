"""Grammar bitmask rows by reference (protocol.bitmask): an encoder's and a
decoder's row tables advance together, every bitmask comes back exact and writable,
repeated rows cost a reference, and hostile references are refused before anything
changes."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.bitmask import Deflated, RowRefs, RowTable, SparseWords, expand, inflate
from protocol.errors import MalformedMessage, RemoteProtocolError
from protocol.packing import pack_uints

_WIRE = msgspec.msgpack.Decoder(tuple[RowRefs, Deflated | None, SparseWords | None])


def _send(enc: RowTable, mask: np.ndarray) -> tuple[RowRefs, Any]:
    """What a decoder gets for ``mask``: the references and the fresh rows array (from
    deflated or sparse words; None when raw or none), through msgpack."""
    return _received(_wire(enc, mask))


def _wire(enc: RowTable, mask: np.ndarray) -> bytes:
    coded = enc.encode(mask)
    assert coded is not None
    return msgspec.msgpack.encode(coded)


def _received(wire: bytes) -> tuple[RowRefs, Any]:
    refs, deflated, sparse = _WIRE.decode(wire)
    return refs, (inflate(deflated) if deflated is not None else
                  expand(sparse) if sparse is not None else None)


@st.composite
def _masks(draw: st.DrawFn) -> list[np.ndarray]:
    """Steps of bitmasks whose rows come from a few grammar states (0 and -1 words with
    a few mixed ones), of one or two widths and dtypes."""
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint8]))
    words = draw(st.sampled_from([1, 3, 16, 600]))
    states = np.where(np.arange(6)[:, None] % 2 == 0, 0, -1) * np.ones((6, words), np.int64)
    for s in range(6):
        states[s, draw(st.integers(0, words - 1))] = draw(st.integers(1, 100))
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()) and draw(st.booleans()):  # now and then another width
            words2 = draw(st.sampled_from([2, 16]))
            steps.append(np.zeros((draw(st.integers(1, 4)), words2), dtype))
            continue
        picks = draw(st.lists(st.integers(0, 5), min_size=1, max_size=40))
        steps.append(states[picks].astype(dtype))
    return steps


@settings(max_examples=60, deadline=None)
@given(_masks())
def test_bitmasks_by_reference_round_trip_exactly(steps: list[np.ndarray]) -> None:
    enc, dec = RowTable(), RowTable()
    for mask in steps:
        refs, fresh = _send(enc, mask)
        got = dec.decode(refs, fresh)
        assert got.dtype == mask.dtype and got.shape == mask.shape
        assert np.array_equal(got, mask)
        got[0, 0] = 1  # fresh and writable, like pickle's
        assert (enc.rows, enc.width, enc.dtype) == (dec.rows, dec.width, dec.dtype)


def test_repeated_rows_cost_a_reference_at_a_real_vocabulary() -> None:
    words = 128256 // 32 + 1  # Llama 3's vocabulary
    rng = np.random.default_rng(0)
    states = np.where(rng.random((8, 1)) < 0.5, -1, 0) * np.ones((8, words), np.int32)
    states[:, 100] = np.arange(1, 9)
    enc, dec = RowTable(), RowTable()
    for step in range(3):
        mask = states[rng.integers(0, 8, 256)]
        wire = _wire(enc, mask)
        assert len(wire) < (2_000 if step == 0 else 300), len(wire)  # then: refs alone
        assert np.array_equal(dec.decode(*_received(wire)), mask)


def test_what_does_not_travel_by_reference_is_left_alone() -> None:
    enc = RowTable()
    for mask in (np.zeros(8, np.int32), np.zeros((0, 4), np.int32), np.zeros((2, 0), np.int32),
                 np.zeros((2, 2), np.float32), np.zeros((2, 2), ">i4"), [[0]], None):
        assert enc.encode(mask) is None
    assert (enc.rows, enc.width) == (b"", 0)
    strided = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]  # not contiguous: copied
    dec = RowTable()
    assert np.array_equal(dec.decode(*_send(enc, strided)), strided)


def _primed() -> tuple[RowTable, RowRefs]:
    """A decoder holding two rows, and a valid next message naming them."""
    enc, dec = RowTable(), RowTable()
    dec.decode(*_send(enc, np.array([[1, 2], [3, 4], [1, 2]], np.int32)))
    refs, fresh = _send(enc, np.array([[3, 4], [5, 6], [1, 2]], np.int32))
    assert fresh is None and refs.table == 2
    return dec, refs


@pytest.mark.parametrize(("change", "error"), [
    ({"table": 1}, RemoteProtocolError),  # a table we do not hold
    ({"dtype": "<i8", "fresh": bytes(16)}, RemoteProtocolError),  # held at another width
    ({"refs": pack_uints([1, 2])}, MalformedMessage),  # not one per row
    ({"refs": pack_uints([1, 3, 0])}, MalformedMessage),  # past the fresh rows
    ({"refs": pack_uints([1, 0, 0])}, MalformedMessage),  # a fresh row never used
    ({"fresh": bytes(16), "refs": pack_uints([3, 2, 0])}, MalformedMessage),  # out of order
    ({"fresh": bytes(7)}, MalformedMessage),  # not whole rows
    ({"shape": (3,)}, MalformedMessage),
    ({"shape": (0, 2)}, MalformedMessage),
    ({"shape": (-3, 2)}, MalformedMessage),
    ({"dtype": "<f4"}, MalformedMessage),
    ({"dtype": "nope"}, MalformedMessage),
    ({"dtype": ""}, MalformedMessage),
    ({"shape": (1 << 20, 1 << 20)}, MalformedMessage),  # claims far too many bytes
    ({"refs": b"\x07"}, MalformedMessage),  # does not unpack
])
def test_hostile_references_are_refused_before_anything_changes(
        change: dict[str, Any], error: type[Exception]) -> None:
    dec, refs = _primed()
    held = (dec.rows, dec.width, dec.dtype)
    with pytest.raises(error) as refused:
        dec.decode(msgspec.structs.replace(refs, **change), None)
    assert type(refused.value) is error
    assert (dec.rows, dec.width, dec.dtype) == held
    assert np.array_equal(dec.decode(refs, None), [[3, 4], [5, 6], [1, 2]])  # still in step


def test_fresh_rows_sent_two_ways_or_of_another_shape_are_malformed() -> None:
    dec, refs = _primed()
    with pytest.raises(MalformedMessage, match="more than one way"):
        dec.decode(msgspec.structs.replace(refs, fresh=bytes(8)), np.zeros((1, 2), np.int32))
    bare = msgspec.structs.replace(refs, fresh=b"")
    for fresh in (np.zeros((1, 3), np.int32), np.zeros((1, 2), np.int64), np.zeros(2, np.int32),
                  b"\x00" * 8):
        with pytest.raises(MalformedMessage, match="dtype or width"):
            dec.decode(bare, fresh)


def test_a_fresh_decoder_refuses_a_bitmask_without_a_dtype() -> None:
    refs = RowRefs("", (1, 1), 0, pack_uints([0]), bytes(4))
    with pytest.raises(MalformedMessage):
        RowTable().decode(refs, None)
