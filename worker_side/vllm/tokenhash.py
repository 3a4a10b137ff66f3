"""A rank's rolling hash of the tokens it sampled (pure; no vLLM, no zmq).

Every rank of the last pipeline stage samples the same tokens from the same
logits; a rank whose tokens differ has diverged (its KV shard and inputs are no
longer those of its peers).  Each such rank folds every model output into one
64-bit rolling hash and checks in with ``(outputs folded, hash)`` every
``every`` outputs, after its reply has gone (off the hot path), so the engine can
compare ranks at equal output counts and name the one that differs.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

from protocol.errors import MalformedMessage

CHECK_IN = struct.Struct("<qQ")  # outputs folded (int64), hash (uint64), little-endian


class TokenHash:
    """``value`` after ``steps`` outputs: blake2b-64 chained over each output's
    request ids, per-request token counts and tokens (in batch order)."""

    def __init__(self) -> None:
        self.steps = 0
        self.value = 0

    def update(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]]) -> None:
        h = hashlib.blake2b(self.value.to_bytes(8, "little"), digest_size=8)
        h.update("\0".join(req_ids).encode())
        h.update(array("q", [len(t) for t in sampled]).tobytes())
        h.update(array("q", [tok for t in sampled for tok in t]).tobytes())
        self.value = int.from_bytes(h.digest(), "little")
        self.steps += 1

    def check_in(self) -> bytes:
        return CHECK_IN.pack(self.steps, self.value)


def parse_check_in(payload: bytes) -> tuple[int, int]:
    """``(steps, value)`` of a check-in payload; raises MalformedMessage if malformed."""
    if len(payload) != CHECK_IN.size:
        raise MalformedMessage("check-in payload is not 16 bytes", size=len(payload))
    steps, value = CHECK_IN.unpack(payload)
    return int(steps), int(value)
