"""The steady lane: same-schedule steps kept on Python ints, written to the state at once.

Theory of operation
-------------------
vLLM's common step repeats the last schedule: every scheduled request advances by
its scheduled count, a few rows gain a block, some counts depart from the forecast
(chunked prefill, accepted drafts) and step-only fields (speculative tokens,
structured-output flags, the extension slot) may change.  :meth:`ReplicaState.apply`
handles such a step with numpy calls and scalar reads and writes (25 µs at 256
requests for a few appends, 100 µs and more for count exceptions).
:class:`SteadyLane` runs the same checks and the same digest arithmetic on Python
ints -- the scheduled rows' table lengths are a list per KV group -- and journals
the step: appends, computed-count corrections by position, and the stretches of
unchanged scheduled counts the requests advanced by.  :meth:`SteadyLane.settle`
writes the journal into the state with a few vectorised calls.  It settles itself
past ``MAX_ROWS`` appended rows, or past ``MAX_SEGMENTS`` count changes while it
does not keep the computed counts (the segments are then how it finds them; one that
keeps them settles past ``MAX_ROWS`` counts journaled in its segments).

Contract: between two settles nothing but the lane touches the state; a user
calls :meth:`settle` before anything else reads or changes it (the vLLM adapter
settles before its general path).  Invariant: the state plus the journal equals
the state :meth:`ReplicaState.apply` of the same bodies would hold, and
:attr:`digest` equals that state's digest.  A body the lane does not take
(:meth:`step` returns None) changes nothing: settle and apply it to the state.
"""

from __future__ import annotations

from operator import add, sub
from typing import TYPE_CHECKING, Any

from protocol import digest as dg
from protocol.errors import InvalidDelta
from protocol.lane_lists import NO_ROWS, LaneRows, add_at, dot, lane_rows, lane_shaped, rows_fit
from protocol.messages import DeltaBody
from protocol.planned import STEADY_BODY
from protocol.speedups import C as _C

if TYPE_CHECKING:
    from protocol.state import ReplicaState

#: one KV group's appends of a step: (batch positions, blocks per row, flat block ids)
Appends = tuple[list[int], list[int], list[int]]
#: one group's appends of one journaled step: (handles, starts, counts, ids, row terms)
Journaled = tuple[list[int], list[int], list[int], list[int], list[int]]
#: settle once the journal holds this many appended rows (bounds its memory)
MAX_ROWS = 1 << 16
#: ... or this many changes of the scheduled counts while it keeps no computed counts
#: (bounds a computed count's lookup through the segments)
MAX_SEGMENTS = 16
#: without the speedups, schedules up to this long open with one keyed sum in Python;
#: longer ones take the state's numpy advance term
FEW_KEYS = 64
_NONE: list[int] = []  # no count exceptions (shared, never extended)
#: a step's planned counts: (digest change, computed positions, their corrections, the new
#: scheduled counts or None, the next advance term)
_Counts = tuple[int, list[int], list[int], list[int] | None, int]
_COUNT_LIMIT = 1 << 62  # larger counts are left to the state's own checks
_BLOCK_ID_LIMIT = 1 << 31  # the block table is int32
_SALT0 = dg.group_salt(0)  # the one KV group's share of its block terms
# (by name: a call with them spelled out passes its arguments without making a tuple)
_K_BLOCK, _K_POS, _K_HANDLE = dg.BLOCK_KEYS


#: ``lane_counts``' answer for a step it took: (digest, the new scheduled counts or None,
#: their advance, the appends' plan or None, the computed counts kept or None)
Counted = tuple[int, list[int] | None, int, Any, list[int] | None]

#: one group's appends with their plan (handles, starts, row terms, their sum)
_Planned = tuple[int, Appends, tuple[list[int], list[int], list[int], int]]


class SteadyLane:
    """Steady steps of one :class:`ReplicaState` (see the module docstring)."""

    def __init__(self, state: ReplicaState) -> None:
        self.state = state
        self.version = -1  # the state's version the lane was opened at (-1: not yet)
        self.steps = 0  # steps journaled since the last settle
        self.digest = state.digest
        self.handles: list[int] = []
        self.keys: list[int] | None = None  # see _keys
        self.skeys: list[int] | None = None  # see _schedule_keys
        self.groups = 0  # KV groups of the state
        #: the scheduled rows' table lengths per group, read from the state when appends
        #: first need them (see lengths): a lane of steady steps never pays for them
        self._lengths: list[list[int]] | None = None
        self.advance = 0
        self.nsched: list[int] = []  # the scheduled counts now (replaced, never edited)
        #: the advances so far: [scheduled counts, steps advanced by them]
        self.segments: list[list[Any]] = []
        self.extra: list[int] = []  # by position: computed-count exceptions summed
        #: the computed counts now, made when an exception first needs them and then kept
        #: up to date (a lane without exceptions never pays for them); replaced by every
        #: step, never edited in place (it may be the caller's list, see _computed)
        self.comp: list[int] | None = None
        #: the state's computed counts of the schedule as a caller gave them (see open)
        self._base: list[int] | None = None
        #: per group, per journaled step: (handles, starts, counts, ids, row terms)
        self.journal: list[list[Journaled]] = []
        self.rows = 0
        #: the last step's body, or its Delta's frame (see counts_taken)
        self.last: DeltaBody | bytes | None = None
        #: the ids the first journaled step finished (a lane of protocol.lane_drop)
        self.finished: frozenset[str] = frozenset()

    def open(self, computed: list[int] | None = None) -> None:
        """Open the lane on the state now, its block lengths included (a no-op while steps
        are journaled or when it is open on this version).  The adapters call it at the
        end of a general step, which costs far more, so that the next same-schedule step
        does not pay for the lists.  ``computed``: the schedule's computed counts as the
        state now holds them, when the caller has them (a general step's actual counts;
        kept and only read): the first count exception starts from them instead of
        reading the state."""
        if self.steps == 0 and self.version != self.state.version:
            self._open()
        if self.steps == 0 and computed is not None and len(computed) == len(self.handles):
            self._base = computed
        if self._lengths is None:
            self._lengths = self._state_lengths()

    def _open(self) -> None:
        state = self.state
        sched = state.schedule
        # A schedule after one whose steps had count exceptions (speculative decoding,
        # chunked prefill) will most likely have them too: its keys are made now, by the
        # general step that opens it, instead of by its first steady step (which
        # follows a turnover's cold caches).  Other lanes make them when first needed.
        counting = _C is not None and self.keys is not None
        reschedules = counting and self.skeys is not None
        self.handles = sched.tolist()
        self.keys = self.skeys = None
        self.groups, self._lengths = len(state.blocks), None
        self.journal = [[] for _ in state.blocks]
        self.digest, self.version, self.rows = state.digest, state.version, 0
        self._restart()
        # the advance term of the schedule (it stays while the lane runs): one keyed sum
        # of the lists at hand (one C loop, or a small one in Python), else the state's
        # numpy term
        if counting:
            self.advance = dot(self.nsched, self._keys()) & dg.MASK
            if reschedules:
                self._schedule_keys()
        elif len(self.handles) <= FEW_KEYS or _C is not None:
            self.advance = dg.computed_change(self.handles, self.nsched)
        else:
            self.advance = state.steady_advance_term()

    @property
    def lengths(self) -> list[list[int]]:
        """The scheduled rows' table lengths per KV group, by position: the state's at the
        open (unchanged until the lane's first append: nothing else touches the state
        between settles) plus the journaled appends."""
        if self._lengths is None:
            self._lengths = self._state_lengths()
        return self._lengths

    def _state_lengths(self) -> list[list[int]]:
        state = self.state
        return [table.lengths[state.schedule].tolist() for table in state.blocks]

    def _restart(self) -> None:
        """Counts journal empty: advances start from the state's scheduled counts."""
        self._base = None  # (see open)
        self.nsched = self.state.nsched.tolist()
        self.segments, self.extra, self.comp = [[self.nsched, 0]], [0] * len(self.nsched), None

    def step(self, body: DeltaBody, appends: list[Appends],
             expected_digest: int | None = None, rows: LaneRows | None = None,
             own_appends: bool = False, own_rows: bool = False) -> int | None:
        """Apply a :func:`lane_shaped` ``body`` whose block appends are ``appends`` (per KV group,
        batch positions; [] for none).  Returns the new digest, or None -- nothing done --
        when the lane cannot take the body (the state then decides).  Raises
        InvalidDelta, nothing done, when the digest differs from ``expected_digest``.

        ``rows``: the body's count and draft rows as lists when the caller has them
        (:func:`lane_rows`, or the lists the body was packed from); the caller then
        vouches that the body is lane-shaped.  Without them the lane checks and unpacks.

        ``own_appends``: the caller made ``appends`` itself from a valid step (positions
        distinct, increasing and scheduled; counts >= 1 summing to the ids), so only the
        ids are checked.  ``own_rows``: likewise the ``rows`` it passes (what
        :meth:`LaneRows.fits` checks holds), so their shape is not checked; the values
        still are."""
        if rows is None and not lane_shaped(body):
            return None
        if not appends and (rows is NO_ROWS or body is STEADY_BODY):
            # no count, draft or block change: the steady advance (step-only flags and
            # the extension enter no digest term; they are the step's, kept as last)
            return self.steady(expected_digest, body)
        if self.steps == 0 and self.version != self.state.version:
            self._open()
        n = len(self.handles)
        if rows is None:
            rows, own_rows = lane_rows(body, n), False
        if rows is NO_ROWS and len(appends) == 1:  # the common same-batch step: short
            digest = self.appended(appends[0], expected_digest, body, own_appends)
            if digest is not None:
                return digest
        if rows is not NO_ROWS and rows is not None:
            digest = self.counted(body, rows, appends, expected_digest, own_rows, own_appends)
            if digest is not None:
                return digest
        if rows is NO_ROWS:  # nothing to check or plan for the counts
            counts: _Counts | None = (0, _NONE, _NONE, None, self.advance)
        elif rows is None or (not own_rows and not rows.fits(n)):
            return None
        else:
            counts = self._plan_counts(rows)
        planned = None if counts is None else self._plan_groups(appends, own_appends)
        if counts is None or planned is None:
            return None
        digest = self.digest + self.advance + counts[0]
        digest = (digest + sum(plan[-1] for _, _, plan in planned)) & dg.MASK
        if expected_digest is not None and digest != expected_digest:
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=digest)
        for g, (pos, rows_n, values), (hs, starts, terms, _) in planned:
            self._commit(g, pos, rows_n, values, hs, starts, terms)
        self._commit_counts(*counts[1:])
        self._taken(digest, body)
        return digest

    def counted(self, body: DeltaBody, rows: LaneRows, appends: list[Appends],
                expected_digest: int | None = None, own_rows: bool = False,
                own_appends: bool = False) -> int | None:
        """:meth:`step` of a lane body with count or draft ``rows`` (not NO_ROWS) and at
        most one KV group's appends in one C call (``lane_counts``: both plans, the
        digest and the commit); :meth:`step` tries it first for such a body.  None,
        nothing done, without the speedups, with more KV groups or when C does not take
        them (:meth:`step` then decides, refusals included).  Raises InvalidDelta,
        nothing done, when the digest differs from ``expected_digest``."""
        if self.steps == 0 and self.version != self.state.version:
            self._open()
        drafts = rows.drafts
        if _C is None or self.groups != 1 or len(appends) > 1 or (
                not own_rows and drafts is not None and (
                    len(drafts[0]) != len(self.handles) or sum(drafts[0]) != len(drafts[1]))):
            return None
        added = appends[0] if appends and appends[0][0] else None
        if appends and added is None and (appends[0][1] or appends[0][2]):
            return None  # ids without rows: the state refuses the shape
        done = self.count_step(rows.computed, rows.scheduled, added,
                               not own_rows or not own_appends, expected_digest)
        return None if done is None else self.counts_taken(done, added, body)

    def count_step(self, computed: tuple[list[int], list[int]] | None,
                   scheduled: tuple[list[int], list[int]] | None, added: Appends | None,
                   check: bool = True, expected_digest: int | None = None) -> Counted | None:
        """The C step of :meth:`counted` (``lane_counts``) from the count rows as lists
        (``computed``, ``scheduled``: (positions, values), None for none) and one group's
        appends ``added`` (None for none); ``check``: the rows are not the caller's own
        (their positions are checked).  Its answer is for :meth:`counts_taken`, which the
        caller must call next (the lengths and corrections are written); None, nothing
        done, when the lane has more KV groups or C does not take the rows.  Raises
        InvalidDelta, nothing done, when the digest differs from ``expected_digest``."""
        if self.steps == 0 and self.version != self.state.version:
            self._open()
        if _C is None or self.groups != 1:
            return None
        at, moves = computed or (_NONE, _NONE)
        pos, values = scheduled or (_NONE, _NONE)
        comp = self.comp if self.comp is not None or not moves else self._computed()
        keys = self.keys if self.keys is not None else \
            self._keys() if moves or pos else _NONE
        skeys = self.skeys if self.skeys is not None else \
            self._schedule_keys() if pos else _NONE
        done = _C.lane_counts(
            comp, self.nsched, keys, at, moves, pos, values, skeys, self.advance, self.extra,
            added, self.handles, self.lengths[0] if added else _NONE, _SALT0, _K_BLOCK, _K_POS,
            _K_HANDLE, check, self.digest, expected_digest)
        if type(done) is int:  # the digest, which differs: nothing done
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=done)
        return done  # type: ignore[no-any-return]

    def count_inputs(self, computed: bool, scheduled: bool, appends: bool,
                     ) -> tuple[Any, ...] | None:
        """The lane's arguments of a one-call step with count rows (``lane_counts``'s
        ``comp`` .. ``k_handle`` and ``base``; its rows and appends are the caller's), made
        for a body with computed rows, scheduled rows and appends as told; None with
        more than one KV group (the lane is then open, nothing else done).  Such a step
        is committed by :meth:`counts_taken`."""
        if self.steps == 0 and self.version != self.state.version:
            self._open()
        if self.groups != 1:
            return None
        # (the kept lists read directly, their makers called only when one is missing)
        comp, keys, skeys, lengths = self.comp, _NONE, _NONE, _NONE
        if computed and comp is None:
            comp = self._computed()
        if computed or scheduled:
            keys = self.keys if self.keys is not None else self._keys()
        if scheduled:
            skeys = self.skeys if self.skeys is not None else self._schedule_keys()
        if appends:
            lengths = (self._lengths if self._lengths is not None else self.lengths)[0]
        return (comp, self.nsched, keys, skeys, self.advance, self.extra, self.handles,
                lengths, _SALT0, _K_BLOCK, _K_POS, _K_HANDLE, self.digest)

    def counts_taken(self, done: Counted, added: Appends | None, body: DeltaBody | bytes,
                     ) -> int:
        """Journal a step ``lane_counts`` took (``done``: its result, the lengths and
        corrections already written; ``added``: the step's one group of appends, None for
        none; ``body``: the step's body, or the frame of its Delta when the caller wrote
        that without the body, decoded only if a settle needs it); returns its digest."""
        digest, nsched, advance, plan, self.comp = done
        if plan is not None and added is not None:  # (a plan is made of appends only)
            self.journal[0].append((plan[0], plan[1], added[1], added[2], plan[2]))
            self.rows += len(plan[0])
        self.segments[-1][1] += 1
        if nsched is not None:
            self.nsched, self.advance = nsched, advance
            self.segments.append([nsched, 0])
        self._taken(digest, body)
        return digest

    def _plan_groups(self, appends: list[Appends], own: bool) -> list[_Planned] | None:
        """(group, appends, :meth:`_plan`) of every group with appends; None when the lane
        cannot take them (one entry per KV group, or none at all, is required)."""
        if appends and len(appends) != self.groups:
            return None
        planned = []
        for g, added in enumerate(appends):
            if not added[0]:
                if added[1] or added[2]:
                    return None  # ids without rows: the state refuses the shape
                continue
            plan = self._plan(g, added, own)
            if plan is None:
                return None
            planned.append((g, added, plan))
        return planned

    def appended(self, rows: Appends, expected_digest: int | None = None,
                 body: DeltaBody = STEADY_BODY, own: bool = False) -> int | None:
        """``step(body, [rows], expected_digest, NO_ROWS, own_appends=own)``: a lane body
        without count exceptions or drafts whose one block change is one KV group's
        appends ``rows`` (non-empty), taken without the general step's branches -- the
        common step of a large batch, where some request crosses a block boundary;
        :meth:`step` tries it first for such a body.  None, nothing done, when the lane
        has more groups or cannot take the rows (:meth:`step` then decides)."""
        if self.steps == 0 and self.version != self.state.version:
            self._open()
        if self.groups != 1 or not rows[0]:
            return None
        lengths = self.lengths
        done = None if _C is None else _C.lane_append(
            *rows, self.handles, lengths[0], _SALT0, *dg.BLOCK_KEYS,
            not own, self.digest + self.advance, expected_digest)  # plan, digest, lengths
        if type(done) is int:  # the digest, which differs: nothing done
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=done)
        if done is None:  # not taken: the same in Python
            plan = self._plan(0, rows, own)
            if plan is None:
                return None
            hs, starts, terms, total = plan
            digest = (self.digest + self.advance + total) & dg.MASK
            if expected_digest is not None and digest != expected_digest:
                raise InvalidDelta("state digest mismatch", expected=expected_digest, got=digest)
            add_at(lengths[0], rows[0], rows[1])
        else:
            hs, starts, terms, digest = done
        self.journal[0].append((hs, starts, rows[1], rows[2], terms))
        self.rows += len(hs)
        self._advanced()
        self._taken(digest, body)
        return digest

    def _advanced(self) -> None:
        """:meth:`_commit_counts` of no exceptions."""
        self.segments[-1][1] += 1
        if self.comp is not None:
            self.comp = list(map(add, self.comp, self.nsched))

    def _taken(self, digest: int, body: DeltaBody | bytes) -> None:
        """The step is journaled: its digest and body are the lane's last."""
        self.digest, self.last = digest, body
        self.steps += 1
        # count changes: past MAX_SEGMENTS while no computed counts are kept (the
        # segments are how they are found), else once they hold MAX_ROWS counts
        # (speculative decoding changes the counts every step)
        segments = len(self.segments)
        if self.rows > MAX_ROWS or (segments > MAX_SEGMENTS and (
                self.comp is None or segments * len(self.handles) > MAX_ROWS)):
            self.settle()

    def steady(self, expected_digest: int | None = None, body: DeltaBody = STEADY_BODY) -> int:
        """:meth:`step` of the empty body (the steady decode step: every scheduled request
        advances by its scheduled count, nothing else changes), or of a lane body that
        changes step-only fields alone (``body``); always taken.  Raises InvalidDelta,
        nothing done, when the digest differs from ``expected_digest``."""
        if self.steps == 0 and self.version != self.state.version:
            self._open()
        digest = (self.digest + self.advance) & dg.MASK
        if expected_digest is not None and digest != expected_digest:
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=digest)
        self._advanced()
        self._taken(digest, body)
        return digest

    def _plan(self, g: int, rows: Appends, own: bool = False,
              ) -> tuple[list[int], list[int], list[int], int] | None:
        """(handles, starts, per-row terms, their sum) of group ``g``'s appends; None
        unless positions are distinct and scheduled, counts >= 1 and ids fit (``own``:
        only the ids are checked, see :meth:`step`)."""
        pos, counts, values = rows
        if _C is not None:  # the same checks and plan in C; None: Python decides below
            plan: tuple[list[int], list[int], list[int], int] | None = _C.plan_rows(
                pos, counts, values, self.handles, self.lengths[g], dg.group_salt(g),
                *dg.BLOCK_KEYS, not own)
            if plan is not None:
                return plan
        if not own and not rows_fit(pos, counts, len(values), len(self.handles)):
            return None
        if min(values) < 0 or max(values) >= _BLOCK_ID_LIMIT:
            return None
        hs = list(map(self.handles.__getitem__, pos))
        starts = list(map(self.lengths[g].__getitem__, pos))
        terms = dg.row_terms(hs, g, starts, counts, values)
        return hs, starts, terms, sum(terms)

    def _plan_counts(self, rows: LaneRows) -> _Counts | None:
        """(digest change, computed positions, their corrections, the new scheduled counts
        or None, the next advance term) of the count exceptions: the checks and terms of
        :mod:`protocol.plan` on an unchanged schedule, in C-level maps (both count terms
        are linear: a change is a product with a cached key); None when one fails (or a
        value is absurdly large: the state's path decides).  One C call with the
        speedups (``plan_counts``; the lines below when it does not take the lists)."""
        change, advance = 0, self.advance
        at, moves = rows.computed or (_NONE, _NONE)
        if _C is not None:
            pos, values = rows.scheduled or (_NONE, _NONE)
            got = _C.plan_counts(self._computed() if moves else _NONE, self.nsched,
                                 self._keys() if moves or pos else _NONE, at, moves, pos, values,
                                 self._schedule_keys() if pos else _NONE, advance)
            if got is not None:
                return got[0], at, moves, got[1], got[2]
        if moves:
            comp, ns = self._computed(), self.nsched
            after = list(map(add, map(comp.__getitem__, at), map(ns.__getitem__, at)))
            after = list(map(add, after, moves))
            if min(after) < 0 or max(after) >= _COUNT_LIMIT:
                return None
            change = dot(moves, self._keys(), at)
        nsched = None
        if rows.scheduled is not None:
            pos, values = rows.scheduled
            if max(values, default=0) >= _COUNT_LIMIT:
                return None
            old = self.nsched
            before = list(map(old.__getitem__, pos))
            if before != values:  # unchanged positions add zero terms below
                deltas = list(map(sub, values, before))
                change += dot(deltas, self._schedule_keys(), pos)
                advance = (advance + dot(deltas, self._keys(), pos)) & dg.MASK
                nsched = list(old)
                for p, v in zip(pos, values, strict=True):
                    nsched[p] = v
        return change & dg.MASK, at, moves, nsched, advance

    def _keys(self) -> list[int]:
        """The schedule's computed-term multipliers by position (``dg.handle_keys``; made
        when count exceptions first need them, kept while the schedule stays)."""
        if self.keys is None:
            self.keys = dg.handle_key_list(self.handles)
        return self.keys

    def _schedule_keys(self) -> list[int]:
        """The schedule's scheduled-count multipliers by position (``dg.schedule_keys``;
        made when a scheduled count first changes, kept while the schedule stays)."""
        if self.skeys is None:
            self.skeys = dg.schedule_key_list(self.handles)
        return self.skeys

    def _computed(self) -> list[int]:
        """The computed counts now, by position (the state's plus the journal's)."""
        if self.comp is None and self.steps == 0 and self._base is not None:
            # nothing journaled since the open: the counts are the caller's, taken as
            # they are (never edited in place: every commit makes a new list first)
            self.comp = self._base
        if self.comp is None:
            # (the caller's list is only read: the lines below make a new one)
            comp = self._base if self._base is not None else \
                self.state.cols.computed[self.state.schedule].tolist()
            for ns, k in self.segments:
                if k:
                    comp = [c + k * x for c, x in zip(comp, ns, strict=True)]
            self.comp = list(map(add, comp, self.extra))
        return self.comp

    def _commit_counts(self, at: list[int], moves: list[int], nsched: list[int] | None,
                       advance: int) -> None:
        self._advanced()  # this step advanced by the counts before its exceptions
        if at:
            add_at(self.extra, at, moves)
            if self.comp is not None:  # (the new list _advanced just made)
                add_at(self.comp, at, moves)
        if nsched is not None:
            self.nsched, self.advance = nsched, advance
            self.segments.append([nsched, 0])

    def _commit(self, g: int, pos: list[int], counts: list[int], values: list[int],
                hs: list[int], starts: list[int], terms: list[int]) -> None:
        add_at(self.lengths[g], pos, counts)
        self.journal[g].append((hs, starts, counts, values, terms))
        self.rows += len(hs)

    def settle(self) -> None:
        """Write the journaled steps into the state (a no-op when there are none)."""
        if not self.steps:
            return
        assert self.last is not None  # noqa: S101 - set by every journaled step
        self.state.absorb_lane(self.segments, self.extra, self.journal, self._lengths or [],
                               self.last, self.digest, self.advance, self.comp,
                               self.finished if self.steps == 1 else frozenset())
        self.steps, self.last, self.finished = 0, None, frozenset()
        self.journal = [[] for _ in range(self.groups)]
        self.version, self.rows = self.state.version, 0
        self._restart()
