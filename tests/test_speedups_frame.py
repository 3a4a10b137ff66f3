"""The plain step's frames (protocol/_speedups_frame.c) against codec's Python lines:
the compact body map header, the plain-frame test on frames and on arbitrary bytes,
and the one-call writer of a plain Delta's frame (the very bytes codec.encode writes).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from protocol import codec, packing
from protocol.messages import Delta, DeltaBody, Rows
from protocol.speedups import C

needs_c = pytest.mark.skipif(C is None, reason="C speedups not built (no C compiler)")


@needs_c
@given(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1),
       st.lists(st.integers(0, 1 << 20), max_size=400), st.booleans())
def test_compact_map_is_the_python_rewrite(seq: int, digest: int, values: list[int],
                                           many: bool) -> None:
    """compact_map rewrites a Delta frame's body map header exactly as
    codec.compact_delta_map's Python lines do (and returns larger frames as they are)."""
    assert C is not None
    extra: dict[str, Any] = (
        {"has_structured_output": True, "num_spec_tokens_to_schedule": 2} if many else {})
    body = DeltaBody(block_append=(Rows(handles=packing.pack_uints(values)),), **extra)
    frame = codec._PLAIN_ENCODER.encode(Delta(epoch=3, seq=seq, digest=digest, body=body))
    with mock.patch.object(codec, "_C", None):
        want = codec.compact_delta_map(frame)
    assert C.compact_map(frame) == want
    assert (want == frame) == (len(frame) > codec.COMPACT_LIMIT)


@needs_c
@given(st.integers(0, (1 << 64) - 1), st.sampled_from(["", "ba", "so", "nc", "ns"]),
       st.booleans(), st.binary(max_size=24))
def test_plain_frame_is_the_python_test(seq: int, field: str, compact: bool,
                                        noise: bytes) -> None:
    """plain_frame answers as codec.may_be_plain on Delta frames (either map header)
    and on arbitrary bytes."""
    assert C is not None
    values: dict[str, dict[str, Any]] = {"ba": {"block_append": (Rows(handles=b"\x01"),)},
              "so": {"has_structured_output": True},
              "nc": {"computed_tokens": Rows(handles=b"\x01"), "block_append": (Rows(),)},
              "ns": {"num_spec_tokens_to_schedule": 3}}
    msg = Delta(epoch=1, seq=seq, digest=seq ^ 5, body=DeltaBody(**values.get(field, {})))
    frame = codec._PLAIN_ENCODER.encode(msg)
    if compact:
        frame = codec.compact_delta_map(frame)
    assert C.plain_frame(frame) == codec.may_be_plain(frame) == (field in ("", "ba", "so"))
    assert C.plain_frame(noise) == codec.may_be_plain(noise)
    assert C.plain_frame(frame[:len(noise)]) == codec.may_be_plain(frame[:len(noise)])


@needs_c
@given(st.lists(st.integers(-1, 1 << 64), min_size=3, max_size=3),
       st.lists(st.one_of(st.binary(max_size=300), st.sampled_from([b"", b"\x07" * 70000])),
                min_size=3, max_size=3), st.booleans(), st.booleans())
@example([5, 6, (1 << 64) - 1], [b"", b"", b"\x01" * 1100], False, True)
def test_plain_delta_writes_the_frame_encode_writes(head: list[int], rows: list[bytes],
                                                    structured: bool, pending: bool) -> None:
    """plain_delta writes exactly codec.encode's frame of the plain Delta (either map
    header: frames over COMPACT_LIMIT keep msgspec's), and refuses ints outside uint64."""
    assert C is not None
    got = C.plain_delta(*head, *rows, structured, pending)
    if not all(0 <= v < 1 << 64 for v in head):
        assert got is None
        return
    body = DeltaBody(block_append=(Rows(*rows),), has_structured_output=structured,
                     pending_structured_output=pending)
    epoch, seq, digest = head
    want = bytes(codec.encode(Delta(epoch, seq, digest, body))[0])
    assert got == want
    with mock.patch.object(codec, "_C", None):
        assert codec.plain_delta_frame(epoch, seq, digest, (rows[0], rows[1], rows[2]),
                                       structured, pending) == want
