"""Growable per-handle storage used by :class:`protocol.state.ReplicaState`.

Handles are small non-negative integers, so per-request numeric state lives in
numpy columns indexed by handle.  Token histories live in :class:`TokenBuffer`,
whose visible prefix is never rewritten in place: views handed out earlier stay
valid (truncation reallocates).
"""

from __future__ import annotations

from operator import add

import numpy as np
import numpy.typing as npt

from protocol.digest import MASK
from protocol.request import IntArray

FEW_WRITES = 8  # rows up to this many are written by a slice each (see BlockTable.write)


class HandleColumns:
    """Numeric columns indexed by handle, grown by doubling."""

    def __init__(self, kv_groups: int, capacity: int = 64) -> None:
        self.kv_groups = kv_groups
        self.live = np.zeros(capacity, dtype=bool)
        self.computed = np.zeros(capacity, dtype=np.int64)
        self.spec_term = np.zeros(capacity, dtype=np.uint64)
        self.token_sum = np.zeros(capacity, dtype=np.uint64)
        self.block_sum = np.zeros((kv_groups, capacity), dtype=np.uint64)
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
        blocks = np.zeros((self.kv_groups, new_cap), dtype=np.uint64)
        blocks[:, :cap] = self.block_sum
        self.block_sum = blocks


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


class BlockTable:
    """One KV group's block tables: a 2D int32 array ``[handle, position]`` plus lengths.

    Appends and replacements are single vectorised scatters.  ``table[h]`` is a
    read-only view of handle ``h``'s row, valid until the next change to that row.
    """

    def __init__(self, capacity: int = 64, width: int = 16) -> None:
        self.table = np.zeros((capacity, width), dtype=np.int32)  # block ids < 2**31
        self.lengths = np.zeros(capacity, dtype=np.int64)

    def __getitem__(self, handle: int) -> IntArray:
        row = self.table[handle, : self.lengths[handle]] if handle < self.lengths.size else _NONE
        row.flags.writeable = False
        return row

    def ensure(self, handle: int, width: int) -> None:
        """Grow (by doubling) so that ``handle`` and ``width`` positions fit."""
        cap, have = self.table.shape
        if handle < cap and width <= have:
            return
        new_cap, new_w = max(cap, handle + 1), have
        if handle >= cap:
            new_cap = max(cap * 2, handle + 1)
        if width > have:
            new_w = max(have * 2, width)
        grown = np.zeros((new_cap, new_w), dtype=np.int32)
        grown[:cap, :have] = self.table
        lengths = np.zeros(new_cap, dtype=np.int64)
        lengths[:cap] = self.lengths
        self.table, self.lengths = grown, lengths

    def write(self, handles: IntArray, starts: IntArray, counts: IntArray,
              values: IntArray) -> None:
        """Row i gets ``values`` (flat, row-major) at positions ``starts[i]..``; its
        length becomes ``starts[i] + counts[i]``."""
        if not handles.size:
            return
        if handles.size <= FEW_WRITES:  # a few rows (a join, a resume): slice writes
            self._write_few(handles.tolist(), starts.tolist(), counts.tolist(), values)
            return
        ends = starts + counts
        self.ensure(int(handles.max()), int(ends.max()))
        if values.size == handles.size and int(counts.min()) == 1:  # one block per row
            self.table[handles, starts] = values
            self.lengths[handles] = ends
            return
        row = np.repeat(np.arange(handles.size), counts)
        offsets = np.cumsum(counts) - counts
        self.table[handles[row], starts[row] + np.arange(values.size) - offsets[row]] = values
        self.lengths[handles] = ends

    def _write_few(self, handles: list[int], starts: list[int], counts: list[int],
                   values: IntArray) -> None:
        """:meth:`write` of a few rows, a slice write each (numpy's fancy indexing costs
        ~15 µs of fixed overhead; a slice write under one)."""
        ends = [s + c for s, c in zip(starts, counts, strict=True)]
        self.ensure(max(handles), max(ends))
        table, lengths, at = self.table, self.lengths, 0
        for h, start, end in zip(handles, starts, ends, strict=True):
            table[h, start:end] = values[at:at + end - start]
            at += end - start
            lengths[h] = end

    def gather(self, handles: IntArray) -> tuple[IntArray, IntArray]:
        """(lengths, flat values) of ``handles``' rows, in order (fresh arrays)."""
        inside = np.minimum(handles, self.lengths.size - 1)
        lengths = np.where(handles < self.lengths.size, self.lengths[inside], 0)
        if not lengths.size or not lengths.max():
            return lengths, np.zeros(0, dtype=np.int32)
        width = int(lengths.max())
        rows = self.table[inside, :width]
        return lengths, rows[np.arange(width) < lengths[:, None]]


_NONE = np.zeros(0, dtype=np.int32)


def absorb_rows_py(table: BlockTable, sums: npt.NDArray[np.uint64],
                   rows: list[tuple[list[int], list[int], list[int], list[int],
                                    list[int]]]) -> None:
    """Journaled appends written in step order: row j's ids at ``table[h, start:]``, its
    length ``start + count`` and ``sums[h] += term`` (mod 2**64); the table grows as
    needed.  The reference of the C ``absorb_rows``."""
    for hs, starts, counts, ids, terms in rows:
        table.ensure(max(hs), max(map(add, starts, counts)))
        cells, lengths, at = table.table, table.lengths, 0
        for h, start, n, term in zip(hs, starts, counts, terms, strict=True):
            if n == 1:
                cells[h, start] = ids[at]
            else:
                cells[h, start:start + n] = ids[at:at + n]
            at += n
            lengths[h] = start + n
            sums[h] = (sums.item(h) + term) & MASK
