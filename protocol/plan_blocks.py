"""Block-table edits of a delta being prepared (a part of :mod:`protocol.plan`).

Per KV group: whole-row replacements, then appends at each row's current end, with
the digest sums the touched rows end with.  Appends alone to installed rows -- the
common step -- take lean paths: Python ints for a few blocks, one digest term per
row when every row gets one block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from protocol import digest as dg
from protocol.messages import Rows
from protocol.packing import unpack_uint_list
from protocol.planned import _EMPTY, _NO_EDIT, BlockEdit, PlannerPart, _row_sums
from protocol.request import IntArray, has_duplicates, member_mask

if TYPE_CHECKING:
    from protocol.state import ReplicaState


class BlockPlanner(PlannerPart):
    """The block part of :class:`protocol.plan._Planner` (a mixin: it uses the planner's
    state, body, liveness, reset handles, digest and row decoding)."""

    appended: dict[int, tuple[IntArray, IntArray, IntArray]]

    def check_live(self, handles: IntArray, what: str) -> None:
        raise NotImplementedError

    def rows(self, rows: Rows, sched: IntArray, signed: bool = False) -> tuple[IntArray, IntArray,
                                                                             IntArray]:
        raise NotImplementedError


    # -- blocks -----------------------------------------------------------------
    def blocks(self, sched: IntArray) -> list[BlockEdit]:
        """Per KV group: replacements, then appends, with the digest sums they leave."""
        groups = self.state.kv_groups
        for name, rows in (("block_replace", self.body.block_replace),
                           ("block_append", self.body.block_append)):
            if rows and len(rows) != groups:
                raise self.fail(f"{name} must have one entry per KV group", groups=groups)
        if not self.body.block_replace and not self.body.block_append:
            return [_NO_EDIT] * groups
        # appends alone (the common step; finished handles reset nothing they could name:
        # an append to one fails the liveness check either way)
        if not self.body.block_replace and not any(map(self.live.item, self.reset)):
            return [self._few_appends(g, rows) or self._block_edit(
                g, (_EMPTY, _EMPTY, _EMPTY), self._block_rows(rows, sched, g))
                for g, rows in enumerate(self.body.block_append)]
        edits = []
        for g in range(groups):
            rep_rows = self.body.block_replace[g] if self.body.block_replace else None
            app_rows = self.body.block_append[g] if self.body.block_append else None
            edit = self._few_edit(g, rep_rows, app_rows)
            if edit is None:
                edit = self._block_edit(g, self._block_rows(rep_rows, sched, g),
                                        self._block_rows(app_rows, sched, g))
            edits.append(edit)
        return edits

    def _few_rows(self, rows: Rows | None, g: int) -> tuple[list[int], list[int],
                                                          list[int]] | None:
        """:meth:`_block_rows` of a few named rows on Python ints (the same checks, in the
        same order); None when they are not a few (the numpy path decides)."""
        if rows is None:
            return [], [], []
        hb, vb = rows.handles, rows.values
        if len(hb) < 2 or not 0 < hb[1] <= dg.SMALL or len(vb) < 2 or vb[1] >= 0x80:
            return None  # byte 1 is the count (one LEB128 byte below 128)
        hs, values = unpack_uint_list(hb), unpack_uint_list(vb)
        counts = unpack_uint_list(rows.counts) if rows.counts else [1] * len(hs)
        if len(counts) != len(hs) or sum(counts) != len(values):
            raise self.fail("rows shape mismatch", rows=len(hs), counts=len(counts),
                            values=len(values))
        live = self.live
        if max(hs) >= live.size or not all([live.item(h) for h in hs]):
            raise self.fail("blocks names a handle that is not live", handles=hs[:8])
        if len(set(hs)) != len(hs):
            raise self.fail("block rows repeat a handle", group=g)
        if values and max(values) >> 31:  # the tables are int32 (SPEC.md §8)
            raise self.fail("block id does not fit 31 bits", group=g, id=max(values))
        return hs, counts, values

    def _few_current(self, g: int, hs: list[int]) -> tuple[list[int], list[int]]:
        """:meth:`_current` on Python ints."""
        table, cols = self.state.blocks[g], self.state.lazy_cols
        inside, reset = min(table.lengths.size, cols.capacity), self.reset
        lens = [0 if h >= inside or h in reset else table.lengths.item(h) for h in hs]
        sums = [0 if h >= inside or h in reset else cols.block_sum.item(g, h) for h in hs]
        return lens, sums

    def _few_edit(self, g: int, rep_rows: Rows | None, app_rows: Rows | None,
                  ) -> BlockEdit | None:
        """:meth:`_block_edit` of a few named rows (replacements and appends, reset handles
        allowed) on Python ints; None when they are not a few."""
        rep = self._few_rows(rep_rows, g)
        app = None if rep is None else self._few_rows(app_rows, g)
        if rep is None or app is None:
            return None
        (rep_hs, rep_counts, rep_values), (app_hs, app_counts, app_values) = rep, app
        _, rep_old = self._few_current(g, rep_hs)
        rep_new = dg.row_terms(rep_hs, g, [0] * len(rep_hs), rep_counts, rep_values)
        starts, app_base = self._few_current(g, app_hs)
        where = {h: i for i, h in enumerate(rep_hs)}
        for i, h in enumerate(app_hs):  # appends after a replacement in the same delta
            if h in where:
                starts[i], app_base[i] = rep_counts[where[h]], rep_new[where[h]]
        added = dg.row_terms(app_hs, g, starts, app_counts, app_values)
        app_new = [(b + a) & dg.MASK for b, a in zip(app_base, added, strict=True)]
        self.digest = (self.digest + sum(rep_new) - sum(rep_old) + sum(added)) & dg.MASK
        app_a = _array(app_hs), _array(app_counts), _array(app_values)
        if app_hs:
            self.appended[g] = app_a
        also_appended = set(app_hs)
        kept = [i for i, h in enumerate(rep_hs) if h not in also_appended]
        return BlockEdit(_array(rep_hs), _array(rep_counts), _array(rep_values), app_a[0],
                         _array(starts), app_a[1], app_a[2],
                         _array([rep_hs[i] for i in kept] + app_hs),
                         np.array([rep_new[i] for i in kept] + app_new, dtype=np.uint64))

    def _block_rows(self, rows: Rows | None, sched: IntArray,
                    g: int) -> tuple[IntArray, IntArray, IntArray]:
        if rows is None:
            return _EMPTY, _EMPTY, _EMPTY
        hs, counts, values = self.rows(rows, sched)
        self.check_live(hs, "blocks")
        if has_duplicates(hs):
            raise self.fail("block rows repeat a handle", group=g)
        if values.size and int(values.max()) >> 31:  # the tables are int32 (SPEC.md §8)
            raise self.fail("block id does not fit 31 bits", group=g, id=int(values.max()))
        return hs, counts, values

    def _current(self, g: int, hs: IntArray) -> tuple[IntArray, npt.NDArray[np.uint64]]:
        """(lengths, digest sums) of rows as the state holds them; reset rows are empty."""
        table, cols = self.state.blocks[g], self.state.lazy_cols
        lens = np.zeros(hs.size, dtype=np.int64)
        sums = np.zeros(hs.size, dtype=np.uint64)
        inside = hs < min(table.lengths.size, cols.capacity)
        lens[inside] = table.lengths[hs[inside]]
        sums[inside] = cols.block_sum[g, hs[inside]]
        if self.reset:
            fresh = member_mask(hs, self.reset)
            lens[fresh], sums[fresh] = 0, 0
        return lens, sums

    def _block_edit(self, g: int, rep: tuple[IntArray, IntArray, IntArray],
                    app: tuple[IntArray, IntArray, IntArray]) -> BlockEdit:
        rep_hs, rep_counts, rep_values = rep
        app_hs, app_counts, app_values = app
        if not rep_hs.size and not self.reset:
            return self._append_only(g, app_hs, app_counts, app_values)
        _, rep_old = self._current(g, rep_hs)
        rep_new = _row_sums(g, rep_hs, np.zeros(rep_hs.size, dtype=np.int64), rep_counts,
                            rep_values)
        starts, app_base = self._current(g, app_hs)
        if rep_hs.size and app_hs.size:  # appends after a replacement in the same delta
            where = {h: i for i, h in enumerate(rep_hs.tolist())}
            for i, h in enumerate(app_hs.tolist()):
                if h in where:
                    starts[i], app_base[i] = rep_counts[where[h]], rep_new[where[h]]
        app_new = app_base + _row_sums(g, app_hs, starts, app_counts, app_values)
        self.digest = (self.digest + dg.total(rep_new) - dg.total(rep_old)
                       + dg.total(app_new) - dg.total(app_base)) & dg.MASK
        if app_hs.size:
            self.appended[g] = (app_hs, app_counts, app_values)
        keep = ~member_mask(rep_hs, app_hs) if rep_hs.size else np.ones(0, dtype=bool)
        return BlockEdit(rep_hs, rep_counts, rep_values, app_hs, starts, app_counts, app_values,
                         np.concatenate([rep_hs[keep], app_hs]),
                         np.concatenate([rep_new[keep], app_new]))

    def _few_appends(self, g: int, rows: Rows) -> BlockEdit | None:
        """:meth:`_append_only` of a few named rows, checked and summed on Python ints
        (the same checks as :meth:`_block_rows`); None when they are not a few."""
        vb = rows.values
        if len(vb) < 2 or vb[1] > dg.SMALL:
            return None  # byte 1 is the count (one LEB128 byte below 128)
        few = self._few_rows(rows, g)
        if few is None:
            return None
        hs, counts, values = few
        lengths, block_sum = self.state.blocks[g].lengths, self.state.lazy_cols.block_sum
        starts = [lengths.item(h) for h in hs]  # live handles: installed, so inside
        sums = dg.row_terms(hs, g, starts, counts, values)
        self.digest = (self.digest + sum(sums)) & dg.MASK
        ends = [(block_sum.item(g, h) + s) & dg.MASK for h, s in zip(hs, sums, strict=True)]
        hs_a, counts_a = np.array(hs, dtype=np.int64), np.array(counts, dtype=np.int64)
        values_a = np.array(values, dtype=np.int64)
        self.appended[g] = (hs_a, counts_a, values_a)
        return BlockEdit(_EMPTY, _EMPTY, _EMPTY, hs_a, np.array(starts, dtype=np.int64),
                         counts_a, values_a, hs_a, np.array(ends, dtype=np.uint64))

    def _append_only(self, g: int, hs: IntArray, counts: IntArray, values: IntArray,
                     ) -> BlockEdit:
        """:meth:`_block_edit` of appends alone to installed rows: Python ints for a few
        blocks; one digest term per row when every row gets one block (a decode step)."""
        if not hs.size:
            return _NO_EDIT
        starts = self.state.blocks[g].lengths[hs]  # live handles: installed, so inside
        base = self.state.lazy_cols.block_sum[g, hs]
        if values.size > dg.SMALL:
            unit = values.size == hs.size and int(counts.min()) == 1
            added = (dg.block_terms_rows(hs, g, starts, values) if unit
                     else _row_sums(g, hs, starts, counts, values))
            self.digest = (self.digest + dg.total(added)) & dg.MASK
        else:
            flat, at, sums = values.tolist(), 0, []
            for h, start, n in zip(hs.tolist(), starts.tolist(), counts.tolist(), strict=True):
                sums.append(dg.block_row_sums(h, g, start, flat[at:at + n]))
                at += n
            added = np.array(sums, dtype=np.uint64)
            self.digest = (self.digest + sum(sums)) & dg.MASK
        self.appended[g] = (hs, counts, values)
        return BlockEdit(_EMPTY, _EMPTY, _EMPTY, hs, starts, counts, values, hs, base + added)


def _array(values: list[int]) -> IntArray:
    return np.array(values, dtype=np.int64) if values else _EMPTY


class FewAppends(NamedTuple):
    """Blocks appended to a few rows of a KV group, checked and summed (Python ints)."""

    handles: list[int]
    starts: list[int]  # each row's length before (where its blocks go)
    counts: list[int]
    values: list[int]  # flat, row after row
    sums: list[int]  # each row's block digest sum after
    change: int  # the digest change (mod 2**64 once summed)


def few_appends(state: ReplicaState, g: int, rows: Rows) -> FewAppends | None:
    """A decode or chunk step's appends to group ``g`` -- a few named rows, at most 127
    blocks -- checked and summed on Python ints.  None when the rows are not of that
    shape or a check fails: :class:`BlockPlanner` then decides (and refuses what it
    refuses); also for block ids that do not fit the int32 table (scalar writes would
    raise)."""
    hb, vb, cb = rows.handles, rows.values, rows.counts
    if len(hb) < 2 or not 0 < hb[1] <= dg.SMALL or len(vb) < 2 or not 0 < vb[1] < 0x80 \
            or (cb and (len(cb) < 2 or cb[1] != hb[1])):  # byte 1: a one-byte LEB128 count
        return None
    hs, values = unpack_uint_list(hb), unpack_uint_list(vb)
    counts = unpack_uint_list(cb) if cb else [1] * len(hs)
    live = state.lazy_cols.live
    if sum(counts) != len(values) or max(values) >> 31 or max(hs) >= live.size \
            or not all([live.item(h) for h in hs]) or len(set(hs)) != len(hs):
        return None
    starts = [state.blocks[g].lengths.item(h) for h in hs]  # live: installed, so inside
    terms = dg.row_terms(hs, g, starts, counts, values)
    block_sum = state.lazy_cols.block_sum
    ends = [(block_sum.item(g, h) + t) & dg.MASK for h, t in zip(hs, terms, strict=True)]
    return FewAppends(hs, starts, counts, values, ends, sum(terms))
