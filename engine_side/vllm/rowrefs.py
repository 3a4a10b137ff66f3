"""Structured-output bitmask rows by reference: rows repeat across requests and steps.

Theory of operation
-------------------
xgrammar gives every request at the same grammar state the same bitmask row, and the
states recur from step to step (a JSON schema has a few dozen).  Each end keeps a
:class:`RowTable`: the distinct rows of the last bitmask that travelled by reference,
in first-use order.  A bitmask then travels as one reference per row (:class:`RowRefs`)
into that table followed by the rows it does not hold -- the *fresh* rows, in
first-use order -- raw, or deflated or as sparse words when that halves them.  At a
real vocabulary a row is 16 KB, so a repeated row costs a byte instead of a row.

Contract: the two tables advance together.  The encoder's table changes with every
bitmask it codes this way, the decoder's with every one it decodes, so each such
GrammarMsg MUST be decoded exactly once, in order (the vLLM channel's order: a rank
that loses a message fails, it never resyncs).  A decoder refuses a message that names
a table it does not hold, or references that do not fit, before anything changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine_side.vllm.schema import (
    Deflated,
    RowRefs,
    SparseWords,
    compact_ways,
    int_array_type,
)
from protocol.errors import MalformedMessage, RemoteProtocolError
from protocol.packing import pack_uints, unpack_uint_list
from protocol.speedups import C as _C

#: fresh rows below this many bytes travel raw (zlib's fixed cost outweighs what it saves)
DEFLATE_MIN = 256


def row_refs_py(table: bytes, rows: bytes, width: int) -> tuple[list[int], bytes, bytes]:
    """(for each ``width``-byte row of ``rows``, its id: the position of the first equal
    ``table`` row, else ``len(table rows) + j`` for the ``j``-th row no table row and no
    earlier row equals; those fresh rows, concatenated; the distinct rows used, in
    first-use order -- the next table): the reference of the C ``row_refs``."""
    t = len(table) // width
    index: dict[bytes, int] = {}
    for k in range(t):
        index.setdefault(table[k * width:(k + 1) * width], k)
    refs: list[int] = []
    fresh: list[bytes] = []
    for i in range(len(rows) // width):
        row = rows[i * width:(i + 1) * width]
        ref = index.get(row)
        if ref is None:
            ref = index[row] = t + len(fresh)
            fresh.append(row)
        refs.append(ref)
    named = [table[k * width:(k + 1) * width] for k in range(t)] + fresh
    return refs, b"".join(fresh), b"".join(named[j] for j in dict.fromkeys(refs))


def row_rebuild_py(table: bytes, fresh: bytes, refs: list[int], width: int,
                   ) -> tuple[bytearray, bytes]:
    """(the rows ``refs`` name -- table rows, then ``fresh`` rows --, the distinct rows
    used in first-use order): the reference of the C ``row_rebuild``.  Raises
    MalformedMessage unless every ref names a row and the fresh rows are each first used
    in order."""
    t, k = len(table) // width, len(fresh) // width
    order = list(dict.fromkeys(refs))
    if min(refs, default=0) < 0 or [j for j in order if j >= t] != list(range(t, t + k)):
        raise MalformedMessage("row refs: references and fresh rows disagree", table=t, fresh=k)
    named = [table[j * width:(j + 1) * width] for j in range(t)] + [
        fresh[j * width:(j + 1) * width] for j in range(k)]
    return bytearray().join(map(named.__getitem__, refs)), b"".join(map(named.__getitem__, order))


class RowTable:
    """One end's table: the distinct rows of the last bitmask coded by reference (one
    bytes object, first-use order), with their dtype and width in bytes."""

    __slots__ = ("dtype", "width", "rows", "_np")

    def __init__(self) -> None:
        self.dtype = ""
        self.width = 0
        self.rows = b""
        self._np: Any = None  # encoding: the numpy dtype of ``dtype`` (an identity check)

    def encode(self, a: Any) -> tuple[RowRefs, Deflated | None, SparseWords | None] | None:
        """(the references with the raw fresh rows, or the fresh rows deflated or as sparse
        words) of a non-empty 2-D native integer array, the table advanced; None,
        nothing changed, for anything else (it travels whole)."""
        if type(a) is not np.ndarray or a.ndim != 2 or not a.size or a.dtype.kind not in "iu" \
                or not a.dtype.isnative:
            return None
        rows = a if a.flags.c_contiguous else np.ascontiguousarray(a)
        width = a.shape[1] * a.itemsize
        if a.dtype is not self._np:  # (numpy's builtin dtypes are singletons)
            self._np, self.dtype, self.width, self.rows = a.dtype, a.dtype.str, 0, b""
        old = self.rows if width == self.width else b""
        got = _C.row_refs(old, rows, width) if _C is not None else None
        refs, fresh, self.rows = got if got is not None else row_refs_py(old, rows.tobytes(),
                                                                          width)
        self.width = width
        deflated = sparse = None
        if len(fresh) >= DEFLATE_MIN:  # raw unless deflating or sparse words halve them
            deflated, sparse = compact_ways(np.frombuffer(fresh, a.dtype).reshape(-1, a.shape[1]))
            if deflated is not None or sparse is not None:
                fresh = b""
        return (RowRefs(self.dtype, a.shape, len(old) // width, pack_uints(refs), fresh),
                deflated, sparse)

    def decode(self, r: RowRefs, fresh: Any) -> Any:
        """The bitmask ``r`` stands for, with its fresh rows raw in ``r.fresh`` or given as
        ``fresh`` (the GrammarMsg's deflated or sparse array; None: none): a fresh
        writable array; the table advanced.  Raises MalformedMessage for references that
        do not fit the rows, RemoteProtocolError for a table we do not hold -- in both
        cases before anything changed."""
        dtype, _ = int_array_type(r.dtype, r.shape, "row refs")
        if len(r.shape) != 2 or not r.shape[0] or not r.shape[1]:
            raise MalformedMessage("row refs: not a non-empty 2-D bitmask", shape=r.shape[:8])
        width, t = r.shape[1] * dtype.itemsize, r.table
        if t and (t * width != len(self.rows) or width != self.width or r.dtype != self.dtype):
            raise RemoteProtocolError("row refs: a table we do not hold", table=t,
                                      ours=len(self.rows) // max(self.width, 1))
        raw = _fresh_bytes(r, fresh, dtype, width)
        refs = unpack_uint_list(r.refs, limit=r.shape[0])
        if len(refs) != r.shape[0]:
            raise MalformedMessage("row refs: not one reference per row", rows=r.shape[0])
        table = self.rows if t else b""
        got = _C.row_rebuild(table, raw, refs, width) if _C is not None else None
        out, self.rows = got if got is not None else row_rebuild_py(table, raw, refs, width)
        self.dtype, self.width = r.dtype, width
        return np.frombuffer(out, dtype).reshape(r.shape)


def _fresh_bytes(r: RowRefs, fresh: Any, dtype: np.dtype[Any], width: int) -> bytes:
    """The fresh rows' bytes from exactly one place; MalformedMessage unless whole rows."""
    if fresh is not None:
        if r.fresh:
            raise MalformedMessage("row refs: fresh rows sent more than one way")
        if type(fresh) is not np.ndarray or fresh.dtype != dtype or fresh.ndim != 2 \
                or fresh.shape[1] != r.shape[1]:
            raise MalformedMessage("row refs: fresh rows of another dtype or width")
        return np.ascontiguousarray(fresh).tobytes()
    if len(r.fresh) % width:
        raise MalformedMessage("row refs: fresh bytes are not whole rows", size=len(r.fresh))
    return r.fresh
