"""Growable per-handle storage of :class:`protocol.state.ReplicaState`.

Handles are small non-negative integers, so per-request numbers live in numpy
columns indexed by handle, and block tables and token histories (block tables kept
only by states that hand them out: the reference engine's workers, snapshots) in 2-D
tables ``[handle, position]`` with a length per handle, written by vector scatters.
Readers get copies (:meth:`RowTable.row`): nothing handed out aliases the tables.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]


class HandleColumns:
    """Numbers per handle: liveness, the spec's digest term, the computed count, the
    position in the current schedule (-1: not scheduled), per KV group the table's
    length and block-term sum, the token count and token-term sum; grown by doubling."""

    _FLAT = ("live", "spec_term", "computed", "pos", "token_len", "token_sum")

    def __init__(self, kv_groups: int, capacity: int = 64) -> None:
        self.live = np.zeros(capacity, dtype=bool)
        self.spec_term = np.zeros(capacity, dtype=np.uint64)
        self.computed = np.zeros(capacity, dtype=np.int64)
        self.pos = np.full(capacity, -1, dtype=np.int64)
        self.token_len = np.zeros(capacity, dtype=np.int64)
        self.token_sum = np.zeros(capacity, dtype=np.uint64)
        self.block_len = np.zeros((kv_groups, capacity), dtype=np.int64)
        self.block_sum = np.zeros((kv_groups, capacity), dtype=np.uint64)

    @property
    def capacity(self) -> int:
        return int(self.live.size)

    def ensure(self, handle: int) -> None:
        """Grow every column so that ``handle`` is a valid index."""
        cap = self.capacity
        if handle < cap:
            return
        new = max(cap * 2, handle + 1)
        for name in self._FLAT:
            old = getattr(self, name)
            grown = np.full(new, -1 if name == "pos" else 0, dtype=old.dtype)
            grown[:cap] = old
            setattr(self, name, grown)
        for name in ("block_len", "block_sum"):
            old = getattr(self, name)
            grown = np.zeros((old.shape[0], new), dtype=old.dtype)
            grown[:, :cap] = old
            setattr(self, name, grown)


class RowTable:
    """Integer rows by handle: a 2-D array ``[handle, position]`` (``dtype``) plus lengths."""

    def __init__(self, dtype: type = np.int32, capacity: int = 64, width: int = 16) -> None:
        self.table: npt.NDArray[np.integer] = np.zeros((capacity, width), dtype=dtype)
        self.lengths = np.zeros(capacity, dtype=np.int64)

    def row(self, handle: int) -> I64:
        """``handle``'s row (a fresh int64 array)."""
        if handle >= self.lengths.size:
            return np.zeros(0, dtype=np.int64)
        return self.table[handle, :self.lengths[handle]].astype(np.int64)

    def gather(self, handles: I64) -> tuple[I64, I64]:
        """The rows of ``handles`` as (lengths, flat int64 values), in order."""
        lengths = np.zeros(handles.size, dtype=np.int64)
        inside = handles < self.lengths.size
        lengths[inside] = self.lengths[handles[inside]]
        width = int(lengths.max()) if lengths.size else 0
        if not width:
            return lengths, np.zeros(0, dtype=np.int64)
        sub = self.table[np.where(inside, handles, 0), :width]
        return lengths, sub[np.arange(width) < lengths[:, None]].astype(np.int64)

    def ensure(self, handle: int, width: int) -> None:
        cap, have = self.table.shape
        if handle < cap and width <= have:
            return
        new_cap = max(cap * 2, handle + 1) if handle >= cap else cap
        new_w = max(have * 2, width) if width > have else have
        grown = np.zeros((new_cap, new_w), dtype=self.table.dtype)
        grown[:cap, :have] = self.table
        lengths = np.zeros(new_cap, dtype=np.int64)
        lengths[:cap] = self.lengths
        self.table, self.lengths = grown, lengths

    def write(self, handle: int, start: int, values: list[int] | I64) -> None:
        """``values`` at positions ``start..`` of ``handle``'s row, which then ends there."""
        end = start + len(values)
        self.ensure(handle, end)
        self.table[handle, start:end] = values
        self.lengths[handle] = end

    def scatter(self, handles: I64, starts: I64, counts: I64, values: I64) -> None:
        """Many rows at once: row ``i`` gets ``counts[i]`` of the flat ``values`` at
        ``starts[i]..`` (a handle at most once)."""
        ends = starts + counts
        self.ensure(int(handles.max()), int(ends.max()))
        if values.size == handles.size and bool((counts == 1).all()):  # one value a row
            self.table[handles, starts] = values
            self.lengths[handles] = ends
            return
        rows = np.repeat(handles, counts)
        offsets = np.cumsum(counts) - counts
        cols = np.repeat(starts - offsets, counts) + np.arange(values.size)
        self.table[rows, cols] = values
        self.lengths[handles] = ends

    def clear(self, handle: int) -> None:
        if handle < self.lengths.size:
            self.lengths[handle] = 0
