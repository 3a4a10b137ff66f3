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
from array import array
from collections.abc import Sequence

from protocol.calls import pack_check_in


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
        """The ``H`` payload (:func:`protocol.calls.pack_check_in`) of the hash so far."""
        return pack_check_in(self.steps, self.value)

