"""Worker → engine messages on the check-in channel (ROUTER/DEALER).

The engine's ROUTER receives the core :class:`CheckIn`, :class:`SnapshotRequest`,
:class:`Hello` and :class:`Goodbye` messages plus :class:`StepResult`, which
carries the tokens a worker sampled for one step (the reference engine runs in
engine-token mode, so the engine needs them back).  Tags 100 and up are reserved
for this module so they never collide with core tags appended to
:mod:`protocol.messages`.  Nothing here is ever unpickled: decoding is msgspec
into typed Structs, and any bad input raises :class:`MalformedMessage`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from protocol.errors import DECODE_ERRORS, MalformedMessage, malformed
from protocol.messages import CheckIn, Goodbye, Hello, Message, SnapshotRequest
from protocol.request import IntArray


class StepResult(Message, frozen=True, tag=100):
    """Tokens sampled by ``rank`` for step ``seq`` of ``epoch``.

    ``rows`` are the batch positions of the requests that sampled (a partial
    prefill chunk samples nothing) and ``tokens`` their tokens, both
    little-endian int32.  ``rejoined`` marks the first step after a snapshot.
    """

    rank: int = 0
    rows: bytes = b""
    tokens: bytes = b""
    rejoined: bool = False

    def token_array(self) -> IntArray:
        return unpack_int32(self.tokens)

    def row_array(self) -> IntArray:
        return unpack_int32(self.rows)


AnyReply = CheckIn | SnapshotRequest | StepResult | Hello | Goodbye

_DECODER = msgspec.msgpack.Decoder(AnyReply)
_ENCODER = msgspec.msgpack.Encoder()


def pack_tokens(tokens: Sequence[int] | IntArray) -> bytes:
    """Tokens as little-endian int32 bytes (vocabularies fit easily)."""
    return np.asarray(tokens, dtype="<i4").tobytes()


def unpack_int32(buf: bytes) -> IntArray:
    if len(buf) % 4:
        raise MalformedMessage("payload is not int32", size=len(buf))
    return np.frombuffer(buf, dtype="<i4").astype(np.int64)


def encode_reply(msg: AnyReply) -> bytes:
    """One frame: replies never carry tensors."""
    return _ENCODER.encode(msg)


def decode_reply(frames: Sequence[Any]) -> AnyReply:
    """Decode a worker's frames; raises MalformedMessage (only) for bad input."""
    if len(frames) != 1:
        raise MalformedMessage("a reply is exactly one frame", frames=len(frames))
    frame = frames[0]
    try:
        return _DECODER.decode(frame.buffer if hasattr(frame, "buffer") else frame)
    except DECODE_ERRORS as exc:
        raise malformed("frame does not decode to a reply", exc) from exc
