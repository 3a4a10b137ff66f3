"""The replicated state shared by the engine mirror and every worker replica.

Theory of operation
-------------------
The engine and each worker hold a ``ReplicaState``.  The engine computes a
delta against its own copy and applies that *same* delta to it, so both sides
run the same code on the same bytes.  Applying is two-phase:
:func:`protocol.plan.prepare` checks everything and computes the resulting
digest; :meth:`ReplicaState.commit` then mutates and cannot fail.

State: live requests by handle (static spec, computed-token count, block table
per KV group, output tokens in engine-token mode), the current schedule with
its scheduled-token counts, and the 64-bit digest of all of it.  The step-only
fields of the last delta (speculative tokens, finished ids, ...) are kept
beside it so :meth:`rebuild` can produce that step's ``ExecuteModelRequest``.

Invariants: ``digest`` always equals :meth:`recompute_digest`; nothing handed
out by :meth:`rebuild` aliases mutable state (block arrays are replaced, never
edited; token views never change; everything else is copied).
"""

from __future__ import annotations

import dataclasses
from itertools import chain
from typing import Any

import msgspec
import numpy as np
from msgspec.structs import replace

from protocol import digest as dg
from protocol.block_cache import patch_later
from protocol.columns import BlockTable, HandleColumns, TokenBuffer, absorb_rows_py
from protocol.errors import DECODE_ERRORS, InvalidDelta, LocalProtocolError, malformed
from protocol.lookahead import Lookahead
from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER, Delta, DeltaBody
from protocol.plan import (
    STEADY_BODY,
    BlockEdit,
    FewAppends,
    Plan,
    StepInfo,
    advance_delta,
    encode_spec_for_hash,
    few_appends,
    lane_step,
    prepare,
    prepare_appends,
    steady_step,
)
from protocol.rebuild import rebuild_request
from protocol.request import ExecuteModelRequest, IntArray, RequestSpec
from protocol.speedups import C as _C
from protocol.state_rows import RequestRows

_EMPTY = np.zeros(0, dtype=np.int64)
_DELTA = msgspec.msgpack.Decoder(Delta)  # a lane's last step kept as its Delta's frame
_EMPTY.flags.writeable = False
#: journaled rows up to this many are absorbed by scalar writes (see _absorb_few)
FEW_ABSORBED = 32


def _frame_body(frame: bytes) -> DeltaBody:
    """The body of a Delta frame a lane kept (lane_view took it: it decodes; any bytes
    that do not are MalformedMessage all the same)."""
    try:
        return _DELTA.decode(frame).body
    except DECODE_ERRORS as exc:
        raise malformed("a lane step's frame does not decode", exc) from exc


class ReplicaState(RequestRows):
    """Pure, columnar replicated state (no I/O, no clock)."""

    def __init__(self, token_mode: int = TOKEN_MODE_WORKER, kv_groups: int = 1) -> None:
        if token_mode not in (TOKEN_MODE_WORKER, TOKEN_MODE_ENGINE):
            raise LocalProtocolError("unknown token mode", token_mode=token_mode)
        if kv_groups < 1:
            raise LocalProtocolError("kv_groups must be >= 1", kv_groups=kv_groups)
        self.token_mode = token_mode
        self.kv_groups = kv_groups
        self._cols = HandleColumns(kv_groups)
        #: computed counts of the schedule after steady advances, not yet written to
        #: ``_cols`` (the steady step skips that scatter; see :attr:`cols`)
        self._pending: IntArray | None = None
        self._ahead: Lookahead | None = None
        self._fresh: IntArray | None = None  # the current step's rebuilt column, unused yet
        self.specs: list[RequestSpec | None] = []
        self.blocks: list[BlockTable] = [BlockTable() for _ in range(kv_groups)]
        self.tokens: list[TokenBuffer | None] = []
        self.schedule: IntArray = _EMPTY
        self.nsched: IntArray = _EMPTY
        self.digest = 0
        self._step = StepInfo()
        #: the last lane body whose step fields :attr:`step` makes when first read (a
        #: settle before a general step, which replaces them, never pays for them)
        self._lane_last: DeltaBody | bytes | None = None
        self._lane_finished: frozenset[str] = frozenset()  # that body's finished ids
        self.version = 0  # counts changes (a :class:`protocol.lane.SteadyLane` checks it)
        self._rebuild_cache: dict[object, object] = {}
        #: (schedule, nsched, their schedule term): see :meth:`schedule_term`
        self._schedule_term: tuple[IntArray, IntArray, int] = (self.schedule, self.nsched, 0)

    # -- applying deltas ------------------------------------------------------------
    def apply(self, body: DeltaBody, expected_digest: int | None = None) -> Plan | None:
        """Apply a delta body; with ``expected_digest``, refuse a mismatch unchanged.

        Returns the applied plan, or None for a steady step: the empty body (see
        :meth:`advance`) or one adding block appends and an extension alone (see
        :meth:`_steady_appends`).  Raises InvalidDelta (state unchanged) for an
        inapplicable delta or a digest mismatch.
        """
        if body == STEADY_BODY:
            self.advance(expected_digest)
            return None
        if body.block_append and self._steady_appends(body, expected_digest):
            return None
        plan = prepare(self, body)
        if expected_digest is not None and plan.digest != expected_digest:
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=plan.digest)
        self.commit(plan)
        return plan

    def advance(self, expected_digest: int | None = None) -> None:
        """Apply the empty delta (the steady decode step): the schedule and its counts
        repeat and every scheduled request's computed count advances by its scheduled
        count.  O(1) digest (the advance term and step fields are cached per schedule);
        the counts come from a :class:`Lookahead` table (one numpy call per few steps)."""
        steady = self._steady()
        digest = (self.digest + steady[2]) & dg.MASK
        if expected_digest is not None and digest != expected_digest:
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=digest)
        self._take_row()
        self.step = steady[3]
        self.digest = digest
        self.version += 1

    def _steady_appends(self, body: DeltaBody, expected_digest: int | None) -> bool:
        """The steady advance plus block appends (and an extension): the common vLLM
        step, applied keeping the :class:`Lookahead` (a general commit drops it).

        The same checks, errors, digest and resulting state as :func:`prepare` and
        :meth:`commit`: rows the Python-int path (:func:`few_appends`) does not take
        are planned by the general block code.  False, with nothing done, when the body
        carries anything else or not one entry per KV group.
        """
        groups = body.block_append
        if len(groups) != self.kv_groups or \
                replace(body, block_append=(), extension={}) != STEADY_BODY:
            return False
        rows_few = [few_appends(self, g, rows) for g, rows in enumerate(groups)]
        fast = [few for few in rows_few if few is not None]
        planned = None if len(fast) == len(rows_few) else prepare_appends(self, body)
        digest = self.digest + sum(few.change for few in fast) if planned is None else planned[2]
        steady = self._steady()
        digest = (digest + steady[2]) & dg.MASK
        if expected_digest is not None and digest != expected_digest:
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=digest)
        self._take_row()
        if planned is None:
            for g, few in enumerate(fast):
                self._commit_few(g, few)
        else:
            self._commit_blocks(planned[0], planned[1], same_schedule=True)
        self._rebuild_cache.pop("template", None)
        step: StepInfo = steady[3]
        if body.extension:
            step = dataclasses.replace(step, extension=dict(body.extension))
        self.step = step
        self.digest = digest
        self.version += 1
        return True

    @property
    def step(self) -> StepInfo:
        """The step-only fields of the last applied delta."""
        last = self._lane_last
        if last is not None:  # a settled lane's last body: the state is as it left it
            self._lane_last = None
            if not isinstance(last, DeltaBody):  # its Delta's frame, read when first needed
                last = _frame_body(last)
            self._step = lane_step(self, last, self._steady()[3], self._lane_finished)
        return self._step

    @step.setter
    def step(self, value: StepInfo) -> None:
        self._step, self._lane_last = value, None

    def steady_advance_term(self) -> int:
        """The digest change of one steady advance of the current schedule (cached)."""
        return self._steady()[2]  # type: ignore[no-any-return]

    def absorb_lane(self, segments: list[list[Any]], extra: list[int],
                    journal: list[list[tuple[list[int], list[int], list[int], list[int],
                                             list[int]]]],
                    lengths: list[list[int]], last: DeltaBody | bytes, digest: int,
                    advance: int, computed_now: list[int] | None = None,
                    finished: frozenset[str] = frozenset()) -> None:
        """Commit the steps a :class:`protocol.lane.SteadyLane` checked and journaled (see
        :mod:`protocol.lane`): the advances ([scheduled counts, steps] per stretch of
        unchanged counts, the last stretch's counts now current) and computed-count
        exceptions by position; per group the appends ((handles, starts, counts, ids,
        row terms) per step) and the schedule's final table lengths; the last body's
        step fields (``last``: the body or its Delta's frame, read when the fields are;
        ``finished``: the ids it finished, :mod:`protocol.lane_drop`); the
        digest and the next advance term.  ``computed_now``: the
        schedule's computed counts after all that, when the lane keeps them (one write
        instead of one add per stretch).  Cannot fail."""
        self._flush()
        self._ahead = self._fresh = None
        computed, sched = self._cols.computed, self.schedule
        if not _write_counts(computed, sched, computed_now):
            for nsched, steps in segments:  # int64 arithmetic wraps like repeated adds
                if steps:
                    computed[sched] += steps * np.array(nsched, dtype=np.int64)
            if any(extra):
                computed[sched] += np.array(extra, dtype=np.int64)
        final = segments[-1][0]
        if final != self.nsched.tolist():
            nsched = np.array(final, dtype=np.int64)
            nsched.flags.writeable = False  # shared by rebuild, replaced on change
            self._cols.last_nsched[sched] = nsched
            self.nsched = nsched
            self._rebuild_cache["advance"] = (sched, nsched, advance)
        for g, rows in enumerate(journal):
            if rows:
                self._absorb_appends(g, rows, lengths[g])
        self._rebuild_cache.pop("template", None)
        if last == STEADY_BODY and not finished:
            self.step = steady_step(self)
        else:  # its step fields are made when first read
            self._lane_last, self._lane_finished = last, finished
        self.digest = digest
        self.version += 1

    def _absorb_appends(self, g: int, rows: list[tuple[list[int], list[int], list[int],
                                                         list[int], list[int]]],
                        lengths: list[int]) -> None:
        self._rebuild_cache.pop(f"blocks{g}", None)  # its cached flat table is stale
        self._rebuild_cache.pop(f"patches{g}", None)
        if sum(len(r[0]) for r in rows) <= FEW_ABSORBED:
            self._absorb_few(g, rows)
            return
        hs, starts, counts, values = (np.fromiter(chain.from_iterable(r[k] for r in rows),
                                                  dtype=np.int64) for k in range(4))
        terms = np.fromiter(chain.from_iterable(r[4] for r in rows), dtype=np.uint64)
        table = self.blocks[g]
        table.write(hs, starts, counts, values)
        table.lengths[self.schedule] = lengths  # (a handle's rows may repeat across steps)
        np.add.at(self._cols.block_sum[g], hs, terms)  # uint64 wraps: sums are mod 2**64

    def _absorb_few(self, g: int, rows: list[tuple[list[int], list[int], list[int],
                                                     list[int], list[int]]]) -> None:
        """:meth:`_absorb_appends` of a few journaled rows: scalar and slice writes in step
        order (numpy's fancy indexing and ``add.at`` cost ~15 µs of fixed overhead), so
        a row appended in several steps ends at its last length.  One C call writes them
        all when the table already fits them (else, or without the speedups,
        :func:`absorb_rows_py`, which grows it)."""
        table, sums = self.blocks[g], self._cols.block_sum[g]
        if _C is None or not _C.absorb_rows(table.table, table.lengths, sums, rows):
            absorb_rows_py(table, sums, rows)

    def _commit_few(self, g: int, few: FewAppends) -> None:
        """:meth:`_commit_blocks` of :func:`few_appends` rows (scalar and slice writes)."""
        table, block_sum = self.blocks[g], self._cols.block_sum
        ends = [start + n for start, n in zip(few.starts, few.counts, strict=True)]
        table.ensure(max(few.handles), max(ends))
        cells, lengths, values, at = table.table, table.lengths, few.values, 0
        for h, start, end, total in zip(few.handles, few.starts, ends, few.sums, strict=True):
            if end == start + 1:
                cells[h, start] = values[at]
            else:
                cells[h, start:end] = values[at:at + end - start]
            at += end - start
            lengths[h] = end
            block_sum[g, h] = total
        patch_later(self, g, (few.handles, few.counts, values), True)

    def _steady(self) -> Any:
        """(schedule, nsched, advance term, step fields) of the steady step (cached)."""
        sched, nsched = self.schedule, self.nsched
        steady: Any = self._rebuild_cache.get("steady")
        if steady is None or steady[0] is not sched or steady[1] is not nsched:
            steady = (sched, nsched, advance_delta(self), steady_step(self))
            self._rebuild_cache["steady"] = steady
        return steady

    def _take_row(self) -> None:
        """The counts of one steady advance: the next look-ahead row."""
        ahead = self.lookahead()
        i = ahead.next
        ahead.next = i + 1
        self._pending = ahead.private[i]  # written back to the columns when next read
        self._fresh = ahead.public[i]  # the rebuilt request's column (handed out once)

    def lookahead(self) -> Lookahead:
        """The steady look-ahead table of the current schedule (built when needed)."""
        ahead = self._ahead
        if ahead is None or not ahead.fits(self.schedule, self.nsched):
            pending = self._pending
            base = pending if pending is not None else self._cols.computed[self.schedule]
            ahead = self._ahead = Lookahead(base, self.schedule, self.nsched)
        return ahead

    def scheduled_computed(self) -> IntArray:
        """The schedule's computed counts, as a fresh array."""
        fresh = self._fresh
        if fresh is not None:
            self._fresh = None
            return fresh
        pending = self._pending
        if pending is not None:
            return pending.copy()
        return self._cols.computed[self.schedule]

    def _drop_ahead(self) -> None:
        """The counts are about to change otherwise than by a steady advance."""
        self._flush()
        self._ahead = self._fresh = None

    @property
    def lazy_cols(self) -> HandleColumns:
        """The columns as they are: ``computed`` may lag steady advances still pending
        (read it through :attr:`cols`); every other column is current."""
        return self._cols

    @property
    def cols(self) -> HandleColumns:
        """The per-handle columns (steady advances still pending are written first)."""
        if self._pending is not None:
            self._flush()
        return self._cols

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._cols.computed[self.schedule] = pending

    def commit(self, plan: Plan) -> None:
        """Mutate the state as ``plan`` says (phase two; cannot fail)."""
        self._drop_ahead()
        self._forget_all(plan.finished.tolist())
        self._install_all(plan.added)
        self._commit_tokens(plan)
        self._commit_blocks(plan.blocks, plan.appended,  # type: ignore[attr-defined]
                            plan.schedule is self.schedule)
        cols = self.cols
        cols.computed[plan.computed_handles] = plan.computed_values
        self._rebuild_cache.pop("template", None)
        if plan.schedule is not self.schedule or plan.nsched is not self.nsched:
            if plan.schedule is not self.schedule:
                self._rebuild_cache.pop("schedule", None)
            if plan.schedule is not self.schedule or plan.added or plan.finished.size:
                # (else the same schedule of the same handles: membership holds)
                cols.in_sched[self.schedule] = False
                cols.in_sched[plan.schedule] = True
            cols.last_nsched[plan.schedule] = plan.nsched
            self.schedule, self.nsched = plan.schedule, plan.nsched
        term = getattr(plan, "schedule_term", None)
        if term is not None:
            self._schedule_term = term
        advance = getattr(plan, "advance", None)
        if advance is not None:  # the next steady advance, known from the changed counts
            self._rebuild_cache["advance"] = (self.schedule, self.nsched, advance)
        self.step = plan.step
        self.digest = plan.digest
        self.version += 1

    def commit_drop(self, finished: list[int], schedule: IntArray, nsched: IntArray, term: int,
                    digest: int) -> None:
        """The finish of :mod:`protocol.lane_drop` (its phase two; cannot fail): the
        ``finished`` handles forgotten, ``schedule`` (the old one less their positions)
        and its ``nsched`` installed with their schedule ``term``, the ``digest`` set."""
        self._drop_ahead()
        self._forget_all(finished)  # (out of the schedule too: the stayers' membership holds)
        self.schedule, self.nsched, self._schedule_term = schedule, nsched, \
            (schedule, nsched, term)
        # no step fields of their own (the lane's step has them): the steady ones, made
        # when read
        self._lane_last, self._lane_finished = STEADY_BODY, frozenset()
        self.digest = digest
        self.version += 1

    def _commit_tokens(self, plan: Plan) -> None:
        sums = self.cols.token_sum
        for h, n in plan.truncate.items():
            self.tokens[h].truncate(n)  # type: ignore[union-attr]
            sums[h] = (int(sums[h]) - plan.truncated_sums[h]) & dg.MASK  # type: ignore[attr-defined]
        rows = plan.token_rows
        if rows is None:
            return
        sums[rows.handles] += rows.sums  # uint64 arithmetic wraps: digest sums are mod 2**64
        bufs, bounds = self.tokens, rows.offsets.tolist()
        for i, h in enumerate(rows.handles.tolist()):
            if bounds[i + 1] > bounds[i]:
                bufs[h].append(rows.values[bounds[i]:bounds[i + 1]])  # type: ignore[union-attr]

    def _commit_blocks(self, edits: list[BlockEdit],
                       appended: dict[int, tuple[IntArray, IntArray, IntArray]],
                       same_schedule: bool) -> None:
        for g, edit in enumerate(edits):
            if not edit.sum_handles.size:
                continue
            table = self.blocks[g]
            if edit.rep_handles.size:
                table.write(edit.rep_handles, np.zeros(edit.rep_handles.size, dtype=np.int64),
                            edit.rep_counts, edit.rep_values)
            table.write(edit.app_handles, edit.app_starts, edit.app_counts, edit.app_values)
            self._cols.block_sum[g, edit.sum_handles] = edit.sums
            patch_later(self, g, appended.get(g), same_schedule)

    # -- reading ----------------------------------------------------------------------
    def live_handles(self) -> IntArray:
        return np.flatnonzero(self.cols.live).astype(np.int64)

    def handle_of(self, h: int) -> RequestSpec:
        spec = self.specs[h] if 0 <= h < len(self.specs) else None
        if spec is None:
            raise LocalProtocolError("handle is not live", handle=h)
        return spec

    def recompute_digest(self) -> int:
        """The digest from scratch, O(state): for tests and periodic verification."""
        total = 0
        for h in self.live_handles().tolist():
            spec = self.handle_of(h)
            total += dg.total(dg.spec_terms([h], [dg.spec_hash(encode_spec_for_hash(spec))]))
            total += dg.total(dg.computed_terms([h], [self.cols.computed[h]]))
            for g in range(self.kv_groups):
                total += dg.total(dg.block_terms(h, g, 0, self.blocks[g][h]))
            buf = self.tokens[h] if h < len(self.tokens) else None
            if buf is not None:
                toks = buf.view()
                total += dg.total(dg.token_terms(np.full(toks.size, h), np.arange(toks.size),
                                                 toks))
        total += dg.schedule_term(self.schedule, self.nsched)
        return total & dg.MASK

    def schedule_term(self) -> int:
        """``dg.schedule_term`` of the current schedule and counts (cached per pair of
        arrays: both are replaced on change, never edited)."""
        cached = self._schedule_term
        if cached[0] is not self.schedule or cached[1] is not self.nsched:
            cached = (self.schedule, self.nsched, dg.schedule_term(self.schedule, self.nsched))
            self._schedule_term = cached
        return cached[2]

    def rebuild(self) -> ExecuteModelRequest:
        """The full request of the last applied step, made of fresh containers."""
        return rebuild_request(self)


def _write_counts(computed: IntArray, sched: IntArray, counts: list[int] | None) -> bool:
    """``computed[sched] = counts``; False, nothing written, without counts or when one
    does not fit int64 (the caller then adds the advances, which wrap as int64 does)."""
    if counts is None:
        return False
    try:
        computed[sched] = np.array(counts, dtype=np.int64)
    except OverflowError:
        return False
    return True
