"""Whole block tables as Ragged arrays (the encoder's general step; a part of it).

The general path hands the mirror every scheduled row's table.  Most general steps
carry the last step's tables (rows that left dropped, this step's appends patched
in) and make only the joiners' rows from the encoder's lists; the
:class:`~engine_side.diffing.BlockHint` tells the mirror which rows changed.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from engine_side.diffing import BlockHint
from protocol.request import Ragged


def ragged(rows: list[list[int]]) -> Ragged:
    """The Ragged of ``rows`` (int64)."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    values = np.fromiter(chain.from_iterable(rows), np.int64, int(lengths.sum()))
    return Ragged(lengths, values)


def keyed_rows(d: dict[str, list[int]], batch: list[str], shift: int = 0) -> Ragged:
    """The rows of ``d`` in ``batch`` order (absent ids: empty rows), values + ``shift``."""
    if not d:
        return Ragged.empty(len(batch))
    r = ragged([d.get(rid, []) for rid in batch])
    return Ragged(r.lengths, r.values + shift) if shift else r


def append_rows(table: Ragged, rows: list[int], new: list[list[int]]) -> Ragged:
    """``table`` with ``new[j]`` appended to row ``rows[j]`` (a fresh Ragged)."""
    counts = np.fromiter((len(b) for b in new), np.int64, len(new))
    if not counts.any():
        return table
    ends = table.offsets()[np.asarray(rows, dtype=np.int64) + 1]
    flat = np.fromiter((v for b in new for v in b), np.int64, int(counts.sum()))
    lengths = table.lengths.copy()
    np.add.at(lengths, np.asarray(rows, dtype=np.int64), counts)
    return Ragged(lengths, np.insert(table.values, np.repeat(ends, counts), flat))


def table_hint(kept: int, rows: list[int], new: list[list[list[int]]]) -> BlockHint:
    """The BlockHint of carried tables: ``kept`` rows, ``new[g][j]`` appended to row
    ``rows[j]`` (ascending) in group ``g`` (rows gaining nothing in a group left out)."""
    grown, added = [], []
    for ids in new:
        counts = [len(b) for b in ids]
        grown.append([r for r, c in zip(rows, counts, strict=True) if c])
        added.append([c for c in counts if c])
    return BlockHint(kept, tuple(grown), tuple(added))
