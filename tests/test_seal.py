"""The HMAC seal (protocol.seal): authenticated, numbered, bound to its label.

Real blobs through the public Sealer/Opener: a blob opens once, in order, only with
its own secret and label; anything else -- replayed, reordered, relabelled, cut,
flipped, garbage -- is BadSeal, and nothing is unpickled before the MAC verified.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.seal import MAC_BYTES, OVERHEAD, VERSION, BadSeal, Opener, Sealer

SECRET = b"s" * 32
UNPICKLED: list[str] = []  # what Trap's unpickling recorded


def _trap(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class Trap:
    """Unpickling it records a side effect (it must never happen for a bad MAC)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self) -> tuple[Any, ...]:
        return _trap, (self.tag,)


def test_round_trip_in_order_and_gaps_allowed() -> None:
    sealer, opener = Sealer(SECRET, b"call"), Opener(SECRET, b"call")
    blobs = [sealer.seal({"n": n, "obj": [n, "x" * n]}) for n in range(5)]
    assert [struct.unpack(">BQ", b[:9]) for b in blobs] == [(VERSION, n) for n in range(1, 6)]
    assert opener.open(blobs[0]) == {"n": 0, "obj": [0, ""]}
    assert opener.open(blobs[3]) == {"n": 3, "obj": [3, "xxx"]}  # a gap: allowed
    with pytest.raises(BadSeal, match="replayed or out of order"):
        opener.open(blobs[2])  # older than the last accepted: reordered
    assert opener.open(memoryview(blobs[4]))["n"] == 4


def test_a_captured_blob_is_refused_when_replayed() -> None:
    sealer, opener = Sealer(SECRET, b"step"), Opener(SECRET, b"step")
    blob = sealer.seal({"meta": 1})
    assert opener.open(blob) == {"meta": 1}
    with pytest.raises(BadSeal, match="replayed"):
        opener.open(blob)
    assert opener.open(sealer.seal({"meta": 2})) == {"meta": 2}  # the refusal changed nothing


def test_the_label_binds_direction_purpose_and_rank() -> None:
    result0, result1 = Sealer(SECRET, b"result:0"), Sealer(SECRET, b"result:1")
    blob = result0.seal({"result": 5})
    with pytest.raises(BadSeal, match="MAC"):
        Opener(SECRET, b"call").open(blob)  # a result replayed as a call
    with pytest.raises(BadSeal, match="MAC"):
        Opener(SECRET, b"result:0").open(result1.seal({"result": 6}))  # rank 1's as rank 0's
    with pytest.raises(BadSeal, match="MAC"):
        Opener(b"t" * 32, b"result:0").open(blob)  # another run's secret
    assert Opener(SECRET, b"result:0").open(blob) == {"result": 5}


def test_empty_short_garbled_and_other_versions_are_refused() -> None:
    opener = Opener(SECRET, b"call")
    good = Sealer(SECRET, b"call").seal({"a": 1})
    for blob in (b"", b"\x01", good[:OVERHEAD], good[:OVERHEAD - 1], b"\x00" * 100):
        with pytest.raises(BadSeal):
            opener.open(blob)
    with pytest.raises(BadSeal, match="another version"):
        opener.open(bytes([VERSION + 1]) + good[1:])
    assert issubclass(BadSeal, RemoteProtocolError)
    assert opener.open(good) == {"a": 1}


def test_every_flipped_byte_is_refused() -> None:
    good = Sealer(SECRET, b"attach").seal({"attach": {0: "info"}, "pad": b"\x00" * 20})
    for i in range(len(good)):
        for bit in (0x01, 0x80):
            bad = bytearray(good)
            bad[i] ^= bit
            with pytest.raises(BadSeal):
                Opener(SECRET, b"attach").open(bytes(bad))


def test_the_mac_is_checked_before_anything_is_unpickled() -> None:
    UNPICKLED.clear()
    blob = Sealer(SECRET, b"step").seal({"trap": Trap("sealed")})
    for opener in (Opener(b"x" * 32, b"step"), Opener(SECRET, b"reply")):
        with pytest.raises(BadSeal):
            opener.open(blob)
    tampered = blob[:OVERHEAD] + pickle.dumps({"trap": Trap("tampered")})
    with pytest.raises(BadSeal, match="MAC"):
        Opener(SECRET, b"step").open(tampered)
    assert UNPICKLED == []  # nothing was unpickled
    assert Opener(SECRET, b"step").open(blob) == {"trap": "sealed"}
    assert UNPICKLED == ["sealed"]


def test_an_authenticated_payload_that_is_not_a_dict_is_refused() -> None:
    """A peer holding the secret can seal anything; the opener still answers typed."""
    import hashlib
    import hmac

    def forged(payload: bytes, counter: int = 1) -> bytes:
        head = struct.pack(">BQ", VERSION, counter)
        mac = hmac.new(SECRET, b"deltacast-seal\x00call\x00" + head + payload,
                       hashlib.sha256).digest()
        assert len(mac) == MAC_BYTES
        return head + mac + payload

    opener = Opener(SECRET, b"call")
    assert opener.open(forged(pickle.dumps({"ok": 1}))) == {"ok": 1}  # the layout as specified
    with pytest.raises(BadSeal, match="not a dict"):
        opener.open(forged(pickle.dumps([1, 2]), 2))
    with pytest.raises(BadSeal, match="does not unpickle"):
        opener.open(forged(b"\x80\x05garbage", 3))
    assert opener.open(forged(pickle.dumps({"ok": 2}), 4)) == {"ok": 2}


def test_local_misuse_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        Sealer(b"", b"call")
    with pytest.raises(LocalProtocolError):
        Opener(SECRET, b"bad\x00label")
    with pytest.raises(LocalProtocolError):
        Sealer(SECRET, b"call").seal([1])  # type: ignore[arg-type]


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=20)


@given(st.lists(st.dictionaries(st.text(max_size=8), _VALUES, max_size=5), min_size=1,
                max_size=5))
def test_random_dicts_round_trip_in_order(dicts: list[dict[str, Any]]) -> None:
    sealer, opener = Sealer(SECRET, b"reply"), Opener(SECRET, b"reply")
    for d in dicts:
        assert opener.open(sealer.seal(d)) == d


@given(st.binary(max_size=200), st.sampled_from([b"call", b"result:0", b"step"]))
def test_arbitrary_bytes_only_ever_raise_bad_seal(blob: bytes, label: bytes) -> None:
    with pytest.raises(BadSeal):
        Opener(SECRET, label).open(blob)


@given(st.data())
def test_any_mutation_of_a_real_blob_is_refused(data: st.DataObject) -> None:
    blob = bytearray(Sealer(SECRET, b"call").seal({"call": ("echo", (1,), {})}))
    i = data.draw(st.integers(0, len(blob) - 1))
    how = data.draw(st.sampled_from(["byte", "cut", "insert"]))
    if how == "byte":
        blob[i] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        del blob[i:]
    else:
        blob.insert(i, data.draw(st.integers(0, 255)))
    with pytest.raises(BadSeal):
        Opener(SECRET, b"call").open(bytes(blob))
