"""Structured-output bitmasks on the wire: the step's grammar message and its row table.

A bitmask is mostly all-zero and all-one words, and xgrammar gives every request at
the same grammar state the same row, states recurring from step to step.  So a
:class:`GrammarMsg` carries the bitmask as a zero-copy frame, deflated (small), as
sparse words (large), or as one reference per row into the receiver's
:class:`RowTable` (the distinct rows of the last bitmask coded that way) followed by
the rows the table does not hold.

Row-table contract: the two tables advance together.  The encoder's table changes with
every bitmask it codes by reference, the decoder's with every one it decodes, so each
such message MUST be decoded exactly once, in order; a decoder refuses a message that
names a table it does not hold, or references that do not fit, before anything
changes.  Pure: no I/O.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import msgspec
import numpy as np

from protocol import kernels
from protocol.errors import MalformedMessage, RemoteProtocolError
from protocol.packing import pack_uints, unpack_uint_list, unpack_uints


class Deflated(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An integer array as zlib-deflated little-endian bytes (sparse grammar bitmasks)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


MAX_INFLATED = 1 << 28  # bytes a Deflated may claim; larger is MalformedMessage


def deflate_sparse(a: Any, min_bytes: int = 256) -> Deflated | None:
    """``a`` deflated when it is an integer ndarray that deflating at least halves."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or a.nbytes < min_bytes:
        return None
    raw = np.ascontiguousarray(a).tobytes()
    packed = zlib.compress(raw, 1)
    return Deflated(a.dtype.str, a.shape, packed) if 2 * len(packed) <= len(raw) else None


def inflate(d: Deflated) -> Any:
    """A fresh writable array; MalformedMessage unless the bytes match dtype and shape."""
    dtype, count = int_array_type(d.dtype, d.shape, "deflated array")
    size = count * dtype.itemsize
    unzip = zlib.decompressobj()
    try:
        raw = unzip.decompress(d.data, size + 1)
    except zlib.error as exc:
        raise MalformedMessage("deflated array: corrupt data", cause=str(exc)) from exc
    if len(raw) != size or not unzip.eof:
        raise MalformedMessage("deflated array: length mismatch", expected=size, got=len(raw))
    return np.frombuffer(raw, dtype).reshape(d.shape).copy()


#: integer arrays up to this size are deflated (zlib finds the rows many requests share);
#: larger ones (a real vocabulary: 4,009 words a row at 128k tokens) are sent as
#: SparseWords, measured 5x faster than zlib there (``engine_side.bench.bitmask``)
DEFLATE_MAX = 16 << 10


class SparseWords(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An integer array as its rows' background words and the words that differ.

    Row ``r`` (``shape[0]`` rows; one row for a 1-D array) is all-zero words when bit
    ``r`` of ``background`` is 0 and all-one words when it is 1, except at the flat
    positions ``p_k = p_{k-1} + gaps[k] + 1`` (``p_{-1} = -1``), which hold ``values``
    (raw words of ``dtype``, in position order).
    """

    dtype: str
    shape: tuple[int, ...]
    background: bytes  # packed uints, one 0/1 per row
    gaps: bytes  # packed uints, one per exception
    values: bytes


def compact_ways(a: Any) -> tuple[Deflated | None, SparseWords | None]:
    """(deflated, sparse words) of an integer array, the way its size picks: sparse
    words above :data:`DEFLATE_MAX` bytes, deflated up to it; None where that way does
    not halve it (then it travels raw)."""
    if getattr(a, "nbytes", 0) > DEFLATE_MAX:
        return None, sparse_words(a)
    return deflate_sparse(a), None


def sparse_words(a: Any) -> SparseWords | None:
    """``a`` as SparseWords when it is a non-empty integer ndarray that this halves at least."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "iu" or a.size == 0:
        return None
    rows = np.ascontiguousarray(a.reshape(a.shape[0] if a.ndim > 1 else 1, -1))
    scanned = None
    if a.dtype.isnative and rows.flags.aligned:
        scanned = kernels.sparse_scan(rows, rows.shape[0], a.itemsize)
    background, gaps, values = scanned if scanned is not None else scan_py(rows)
    if 2 * len(values) > a.nbytes:
        return None
    return SparseWords(a.dtype.str, a.shape, pack_uints(np.frombuffer(background, np.uint8)),
                       pack_uints(np.frombuffer(gaps, np.int64)), values)


def scan_py(rows: Any) -> tuple[bytes, bytes, bytes]:
    """(one byte per row: 1 when more than half its words are all ones, else 0; the gaps
    between the flat positions of the words that differ from their row's background,
    as int64; those words' bytes): the reference of ``kernels.sparse_scan``."""
    zero: Any = np.zeros((), rows.dtype)
    ones = rows == ~zero
    background = np.add.reduce(ones, axis=1) * 2 > rows.shape[1]
    at = np.flatnonzero(np.where(background[:, None], ~ones, rows != 0))
    gaps = np.diff(at, prepend=-1) - 1
    return (background.astype(np.uint8).tobytes(), gaps.astype(np.int64).tobytes(),
            rows.ravel()[at].tobytes())


def expand(w: SparseWords) -> Any:
    """A fresh writable array; MalformedMessage unless rows, positions and words fit
    dtype and shape."""
    dtype, size = int_array_type(w.dtype, w.shape, "sparse words")
    rows = w.shape[0] if len(w.shape) > 1 else 1
    background = unpack_uints(w.background, limit=max(rows, 1))
    gaps = unpack_uints(w.gaps, limit=max(size, 1))
    if not w.shape or background.size != rows or int(background.max(initial=0)) > 1:
        raise MalformedMessage("sparse words: bad background", rows=rows)
    if gaps.size * dtype.itemsize != len(w.values) or int(gaps.max(initial=0)) >= size:
        raise MalformedMessage("sparse words: gaps and values disagree", count=gaps.size)
    at = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if at.size and int(at[-1]) >= size:
        raise MalformedMessage("sparse words: position out of range", size=size)
    zero: Any = np.zeros((), dtype)
    fill = np.where(background.astype(bool), ~zero, zero).astype(dtype)
    out = np.repeat(fill, size // rows if rows else 0)
    out[at] = np.frombuffer(w.values, dtype)
    return out.reshape(w.shape)


#: the integer dtypes a peer may name, by numpy's dtype string (``ndarray.dtype.str``)
_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name) for name in ["|i1", "|u1"] + [f"{order}{kind}{size}" for order in "<>"
                                                       for kind in "iu" for size in "248"]}


def int_array_type(name: str, shape: tuple[int, ...], what: str) -> tuple[np.dtype[Any], int]:
    """(dtype, element count) of an integer array a peer describes; MalformedMessage for
    a dtype string not among ``|i1``, ``|u1``, ``<i2`` .. ``>u8``, a negative dimension or
    more than MAX_INFLATED bytes."""
    dtype = _DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise MalformedMessage(f"{what}: bad dtype", dtype=str(name)[:20])
    size = math.prod(shape)
    if min(shape, default=0) < 0 or size * dtype.itemsize > MAX_INFLATED:
        raise MalformedMessage(f"{what}: bad dtype or shape", shape=shape[:8])
    return dtype, size


class RowRefs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A 2-D integer bitmask as one reference per row (see :class:`RowTable`).

    ``refs`` (packed, one per row): below ``table``, a row of the receiver's row table
    (which then MUST hold exactly ``table`` rows of this dtype and width); from
    ``table`` on, the fresh rows the message carries, each first used in order.  The
    fresh rows travel raw in ``fresh``, or -- ``fresh`` empty -- as the GrammarMsg's
    deflated or sparse (k, words) array.
    """

    dtype: str
    shape: tuple[int, ...]
    table: int
    refs: bytes
    fresh: bytes


class GrammarMsg(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """sample_tokens(GrammarOutput): request ids as positions in step ``seq``'s batch.

    The bitmask is a zero-copy frame, or nil with ``deflated`` set (up to
    :data:`DEFLATE_MAX` bytes) or ``sparse`` set (larger) when that halves it at
    least (a bitmask is mostly 0 and -1 words).  With ``rows`` set, those ways carry
    only the fresh rows (none: no way) and ``rows`` the references that rebuild it.
    """

    seq: int
    positions: bytes
    names: tuple[str, ...]
    bitmask: Any
    drafts: list[int] | None = None
    deflated: Deflated | None = None
    sparse: SparseWords | None = None
    rows: RowRefs | None = None


#: fresh rows below this many bytes travel raw (zlib's fixed cost outweighs what it saves)
DEFLATE_MIN = 256


def row_refs_py(table: bytes, rows: bytes, width: int) -> tuple[list[int], bytes, bytes]:
    """(for each ``width``-byte row of ``rows``, its id: the position of the first equal
    ``table`` row, else ``len(table rows) + j`` for the ``j``-th row no table row and no
    earlier row equals; those fresh rows, concatenated; the distinct rows used, in
    first-use order -- the next table): the reference of ``kernels.row_refs``."""
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
    used in first-use order): the reference of ``kernels.row_rebuild``.  Raises
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
        got = kernels.row_refs(old, rows, width)
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
        got = kernels.row_rebuild(table, raw, refs, width)
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
