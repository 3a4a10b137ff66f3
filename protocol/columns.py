"""Growable per-handle storage used by :class:`protocol.state.ReplicaState`.

Handles are small non-negative integers, so per-request numeric state lives in
numpy columns indexed by handle.  Token histories live in :class:`TokenBuffer`,
whose visible prefix is never rewritten in place: views handed out earlier stay
valid (truncation reallocates).
"""

from __future__ import annotations

import numpy as np

from protocol.request import IntArray


class HandleColumns:
    """Numeric columns indexed by handle, grown by doubling."""

    def __init__(self, kv_groups: int, capacity: int = 64) -> None:
        self.kv_groups = kv_groups
        self.live = np.zeros(capacity, dtype=bool)
        self.computed = np.zeros(capacity, dtype=np.int64)
        self.spec_term = np.zeros(capacity, dtype=np.uint64)
        self.token_sum = np.zeros(capacity, dtype=np.uint64)
        self.block_sum = np.zeros((kv_groups, capacity), dtype=np.uint64)
        self.block_len = np.zeros((kv_groups, capacity), dtype=np.int64)
        self.last_nsched = np.zeros(capacity, dtype=np.int64)
        self.in_sched = np.zeros(capacity, dtype=bool)

    @property
    def capacity(self) -> int:
        return int(self.live.size)

    def ensure(self, handle: int) -> None:
        """Grow every column so that ``handle`` is a valid index."""
        cap = self.capacity
        if handle < cap:
            return
        new_cap = max(cap * 2, handle + 1)
        for name in ("live", "computed", "spec_term", "token_sum", "last_nsched", "in_sched"):
            old = getattr(self, name)
            grown = np.zeros(new_cap, dtype=old.dtype)
            grown[:cap] = old
            setattr(self, name, grown)
        for name in ("block_sum", "block_len"):
            old2 = getattr(self, name)
            grown2 = np.zeros((self.kv_groups, new_cap), dtype=old2.dtype)
            grown2[:, :cap] = old2
            setattr(self, name, grown2)


class TokenBuffer:
    """An append-only token history with copy-on-truncate.

    ``view()`` returns a read-only view of the current tokens; later appends
    write past its end and truncation moves to a new buffer, so a view never
    changes after it is handed out.
    """

    __slots__ = ("_buf", "_len")

    def __init__(self, tokens: IntArray | None = None) -> None:
        initial = np.asarray(tokens if tokens is not None else [], dtype=np.int64)
        self._buf = np.zeros(max(16, initial.size * 2), dtype=np.int64)
        self._buf[: initial.size] = initial
        self._len = int(initial.size)

    def __len__(self) -> int:
        return self._len

    def view(self) -> IntArray:
        out = self._buf[: self._len]
        out.flags.writeable = False
        return out

    def last(self) -> int:
        """The newest token (the buffer must not be empty)."""
        return int(self._buf[self._len - 1])

    def append(self, tokens: IntArray) -> None:
        end = self._len + tokens.size
        if end > self._buf.size:
            grown = np.zeros(max(end, self._buf.size * 2), dtype=np.int64)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : end] = tokens
        self._len = end

    def truncate(self, length: int) -> None:
        fresh = np.zeros(max(16, self._buf.size), dtype=np.int64)
        fresh[:length] = self._buf[:length]
        self._buf, self._len = fresh, length
