"""Computed and scheduled token counts of a delta being prepared (a part of
:mod:`protocol.plan`).

On an unchanged schedule every scheduled request advances by its scheduled count
(one advance term) and the body's exceptions move a few rows (one keyed product
each).  A changed schedule of a few rows runs on Python ints, a larger one on
numpy; both give the same checks, errors and digest.
"""

from __future__ import annotations

from itertools import filterfalse
from operator import add, sub
from typing import TYPE_CHECKING

import numpy as np

from protocol import digest as dg
from protocol.messages import Rows
from protocol.planned import Added, PlannerPart, advance_delta
from protocol.request import IntArray, member_mask

if TYPE_CHECKING:
    pass

#: changed schedules up to this many rows take the Python-int paths of the counts
FEW_ROWS = 64


class CountPlanner(PlannerPart):
    """The count part of :class:`protocol.plan._Planner` (a mixin: it uses the planner's
    state, body, liveness, reset handles, digest and exception decoding)."""

    advance: int | None
    schedule_term: tuple[IntArray, IntArray, int] | None

    def positions(self, rows: Rows | None, sched: IntArray, signed: bool) -> tuple[IntArray,
                                                                                  IntArray]:
        raise NotImplementedError

    def exceptions(self, rows: Rows, n: int, signed: bool) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def _unchanged_schedule(self, sched: IntArray) -> bool:
        return sched is self.state.schedule and not self.reset

    def computed(self, sched: IntArray, added: list[Added]) -> tuple[IntArray, IntArray]:
        cols, prev = self.state.cols, self.state.schedule
        if self._unchanged_schedule(sched):
            self.digest = (self.digest + advance_delta(self.state)) & dg.MASK
            new = cols.computed[sched] + self.state.nsched  # the steady advance
            if self.body.computed_tokens is not None:
                at, moves = self.exceptions(self.body.computed_tokens, sched.size, True)
                if at:
                    hs = self._move_computed(new, sched, at, moves)
                    self.digest = (self.digest + dg.computed_change(hs, moves)) & dg.MASK
            return sched, new
        if sched.size <= FEW_ROWS and prev.size <= FEW_ROWS:
            return self._few_computed(sched, added)
        base = np.zeros(self.live.size, dtype=np.int64)
        base[: cols.capacity] = cols.computed[: self.live.size]
        for a in added:
            base[a.handle] = a.computed
        new = base.copy()
        advanced = prev[~member_mask(prev, self.reset)] if self.reset else prev
        new[advanced] += cols.last_nsched[advanced]
        pos, deltas = self.positions(self.body.computed_tokens, sched, signed=True)
        new[sched[pos]] += deltas
        changed = np.unique(np.concatenate([advanced, sched[pos]])) if pos.size else advanced
        if changed.size and new[changed].min() < 0:
            raise self.fail("computed tokens would become negative")
        # linear terms: the change is the moved counts times the handles' keys
        moved = dg.computed_change(changed.tolist(), (new[changed] - base[changed]).tolist())
        self.digest = (self.digest + moved) & dg.MASK
        return changed, new[changed]

    def _few_computed(self, sched: IntArray, added: list[Added]) -> tuple[IntArray, IntArray]:
        """:meth:`computed` of a changed schedule of a few rows on Python ints (the same
        checks and result; a count past int64 is refused as the numpy path's wrapped
        negative one is)."""
        cols, reset = self.state.cols, self.reset
        computed, last, inside = cols.computed, cols.last_nsched, min(cols.capacity,
                                                                      self.live.size)
        fresh = {a.handle: a.computed for a in added}

        def base(h: int) -> int:
            return fresh[h] if h in fresh else computed.item(h) if h < inside else 0

        prev = self.state.schedule.tolist()
        advanced = list(filterfalse(reset.__contains__, prev)) if reset else prev
        # C-level maps over the rows that advance: live, not reset, so not fresh and inside
        old = dict(zip(advanced, map(computed.item, advanced), strict=True))
        new = dict(zip(advanced, map(add, old.values(), map(last.item, advanced)),
                       strict=True))
        rows = self.body.computed_tokens
        at, moves = self.exceptions(rows, sched.size, True) if rows is not None else ([], [])
        for p, d in zip(at, moves, strict=True):
            h = sched.item(p)
            if h not in new:
                old[h] = new[h] = base(h)
            new[h] += d
        changed = sorted(new)  # (any order: the handles are scattered and summed)
        after = list(map(new.__getitem__, changed))
        if after and (min(after) < 0 or max(after) >> 63):
            raise self.fail("computed tokens would become negative")
        moved = dg.computed_change(changed, list(map(sub, after, map(old.__getitem__, changed))))
        self.digest = (self.digest + moved) & dg.MASK
        return np.array(changed, dtype=np.int64), np.array(after, dtype=np.int64)

    def _move_computed(self, new: IntArray, sched: IntArray, at: list[int],
                       moves: list[int]) -> list[int]:
        """Add ``moves`` to ``new`` at positions ``at`` (refusing a negative result);
        returns the handles there."""
        if len(at) <= dg.SMALL:  # a few items: scalar access beats fancy indexing
            for i, d in zip(at, moves, strict=True):
                value = new.item(i) + d
                if value < 0:
                    raise self.fail("computed tokens would become negative")
                if value >> 63:
                    raise self.fail("computed tokens overflow int64")
                new[i] = value
            return [sched.item(i) for i in at]
        where = np.array(at, dtype=np.int64)
        new[where] += moves
        if new[where].min() < 0:
            raise self.fail("computed tokens would become negative")
        return sched[where].tolist()  # type: ignore[no-any-return]

    def nsched(self, sched: IntArray) -> IntArray:
        cols, state = self.state.cols, self.state
        if self._unchanged_schedule(sched):
            if self.body.scheduled_tokens is None:
                return state.nsched  # repeats: same object, schedule term unchanged
            return self._changed_nsched(sched)
        if sched.size <= FEW_ROWS:
            return self._few_nsched(sched)
        cap = cols.capacity
        known = np.zeros(sched.size, dtype=bool)
        inside = sched < cap
        known[inside] = cols.in_sched[sched[inside]]
        if self.reset:
            known &= ~member_mask(sched, self.reset)
        pred = np.ones(sched.size, dtype=np.int64)
        pred[known] = cols.last_nsched[sched[known]]
        pos, vals = self.positions(self.body.scheduled_tokens, sched, signed=False)
        pred[pos] = vals
        pred.flags.writeable = False  # installed as the state's nsched, shared by rebuild
        if sched is not state.schedule or not np.array_equal(pred, state.nsched):
            new_t = dg.schedule_term(sched, pred)
            self.digest = (self.digest - state.schedule_term() + new_t) & dg.MASK
            self.schedule_term = (sched, pred, new_t)
        return pred

    def _few_nsched(self, sched: IntArray) -> IntArray:
        """:meth:`nsched` of a changed schedule of a few rows on Python ints (the same
        checks and result)."""
        state, cols, reset = self.state, self.state.cols, self.reset
        cap, in_sched, last = cols.capacity, cols.in_sched, cols.last_nsched
        pred = [last.item(h) if h < cap and in_sched.item(h) and h not in reset else 1
                for h in sched.tolist()]
        rows = self.body.scheduled_tokens
        if rows is not None:
            for p, v in zip(*self.exceptions(rows, sched.size, False), strict=True):
                pred[p] = v
        out = np.array(pred, dtype=np.int64)
        out.flags.writeable = False  # installed as the state's nsched, shared by rebuild
        if sched is not state.schedule or pred != state.nsched.tolist():
            new_t = dg.schedule_term(sched, out)
            self.digest = (self.digest - state.schedule_term() + new_t) & dg.MASK
            self.schedule_term = (sched, out, new_t)
        return out

    def _changed_nsched(self, sched: IntArray) -> IntArray:
        """Scheduled counts with exceptions on an unchanged schedule: only the changed
        positions' schedule terms move; the advance term of the new counts follows."""
        state = self.state
        pos, vals = self.exceptions(self.body.scheduled_tokens, sched.size, False)  # type: ignore[arg-type]
        old = state.nsched
        pred = old.copy()
        moved, before, after = _moved(pred, pos, vals)
        pred.flags.writeable = False  # installed as the state's nsched, shared by rebuild
        hs = [sched.item(i) for i in moved] if len(moved) <= dg.SMALL else sched[moved].tolist()
        self.digest = (self.digest + dg.schedule_change(hs, moved, before, after)) & dg.MASK
        change = dg.computed_change(hs, [b - a for a, b in zip(before, after, strict=True)])
        self.advance = (advance_delta(state) + change) & dg.MASK
        return pred


def _moved(pred: IntArray, pos: list[int], vals: list[int]) -> tuple[list[int], list[int],
                                                                     list[int]]:
    """Write ``vals`` into ``pred`` at ``pos``; (positions, old, new) of the values changed."""
    if len(pos) > dg.SMALL:
        where, values = np.array(pos, dtype=np.int64), np.array(vals, dtype=np.int64)
        differs = pred[where] != values
        moved, before = where[differs], pred[where][differs]
        pred[where] = values
        return moved.tolist(), before.tolist(), values[differs].tolist()
    moved, before, after = [], [], []
    for i, v in zip(pos, vals, strict=True):  # a few items: scalar access
        was = pred.item(i)
        if was != v:
            moved.append(i)
            before.append(was)
            after.append(v)
            pred[i] = v
    return moved, before, after
