"""Phase one of applying a body, its first half: who is live and scheduled afterwards.

SPEC.md §8.3 steps 1-3 and the predictions of steps 6-7: the finishes, the adds (an
add whose handle is live replaces it), the new schedule (the previous one less the
dropped positions, then the appended handles; or a whole new one) with each position's
predicted scheduled count, and the digest change of the entries that end or start and
of the previous schedule's steady advance.  Checks are O(changes) unless the whole
schedule is sent; nothing is mutated (:mod:`protocol.state` commits).  A body that
names no finish, add or schedule edit costs a few attribute reads.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import NamedTuple, Protocol

import numpy as np

from protocol import digest as dg
from protocol.columns import I64, HandleColumns
from protocol.errors import DECODE_ERRORS, InvalidDelta, malformed
from protocol.messages import (
    MAX_COUNT,
    MAX_HANDLE,
    TOKEN_MODE_ENGINE,
    DeltaBody,
    NewRequest,
    Spec,
    decode_spec,
)
from protocol.packing import unpack_uint_list, unpack_uints

MASK = dg.MASK
_NO_HANDLES: frozenset[int] = frozenset()
Add = tuple[int, NewRequest, Spec, int, "I64 | None"]  # handle, request, spec, term, tokens


class StateView(Protocol):
    """What this module reads of a :class:`protocol.state.ReplicaState`."""

    token_mode: int
    cols: HandleColumns
    specs: list[Spec | None]
    schedule: I64
    nsched: I64
    advance: int


class RowSet(NamedTuple):
    """Decoded :class:`Rows`: row keys (schedule positions), values per row, flat values."""

    keys: list[int]
    counts: list[int]
    values: list[int]


class Applied:
    """What one applied body did, decoded (receivers build their step objects from it).

    ``finished``: handles whose entries ended; ``finished_ids``: their ids, then the
    body's unknown ids; ``added``: handles added, in body order, ``specs`` their specs
    and ``prompts`` their decoded prompts (None when the caller gave the specs, or
    without token ids);
    ``schedule_changed``, and how: ``dropped`` positions of the previous schedule and
    ``appended`` handles (both empty when a whole new schedule came); per KV
    group the decoded block rows ``blocks`` (appended) and ``replaced`` (None: none);
    ``recounted``, the positions whose scheduled count the body set (step 7); the
    step-only fields checked and decoded (step 8): ``spec_rows`` and ``encoder_rows``,
    ``preempted`` and ``resumed`` handles, ``zero`` (blocks to zero, None: absent).
    Lists are shared empty ones until something fills them: read, never extend.
    """

    __slots__ = ("finished", "finished_ids", "added", "specs", "prompts", "schedule_changed",
                 "dropped", "appended", "blocks", "replaced", "body", "recounted",
                 "spec_rows", "encoder_rows", "preempted", "resumed", "zero")

    def __init__(self) -> None:
        self.body: DeltaBody | None = None  # the body applied (the engine's, completed)
        self.finished: list[int] = _NONE
        self.finished_ids: list[str] = _NONE  # type: ignore[assignment]
        self.added: list[int] = _NONE
        self.specs: list[Spec] = _NONE  # type: ignore[assignment]
        self.prompts: list[list[int] | None] = _NONE  # type: ignore[assignment]
        self.schedule_changed = False
        self.dropped: list[int] = _NONE  # positions of the previous schedule dropped, and
        self.appended: list[int] = _NONE  # the handles appended (empty for a whole schedule)
        self.blocks: list[RowSet | None] = _NONE  # type: ignore[assignment]
        self.replaced: list[RowSet | None] = _NONE  # type: ignore[assignment]
        self.recounted: list[int] = _NONE  # positions whose scheduled count the body set
        # the step-only fields, checked and decoded: draft tokens and encoder inputs by
        # schedule position, preempted and resumed handles, blocks to zero
        self.spec_rows: RowSet | None = None
        self.encoder_rows: RowSet | None = None
        self.preempted: list[int] = _NONE
        self.resumed: list[int] = _NONE
        self.zero: list[int] | None = None


_NONE: list[int] = []  # Applied's shared empty lists (never extended)


def decode_added_spec(new: NewRequest) -> Spec:
    """The spec of an added request (MalformedMessage for bytes that do not decode)."""
    try:
        return decode_spec(new.spec)
    except DECODE_ERRORS as exc:
        raise malformed("a spec does not decode", exc) from exc


class Membership:
    """The new schedule, its predicted counts (per position, before exceptions), the
    digest change of the entries that end or start and of the steady advance, the
    handles reset (finished or added) and the adds."""

    __slots__ = ("state", "schedule", "counts", "change", "reset", "adds", "cut",
                 "appended", "kept_reset")

    def __init__(self, state: StateView, schedule: I64, counts: I64, change: int = 0,
                 cut: list[int] | None = None, appended: list[int] | None = None,
                 kept_reset: list[int] | None = None) -> None:
        self.state, self.schedule, self.counts, self.change = state, schedule, counts, change
        self.reset: set[int] | frozenset[int] = _NO_HANDLES
        self.adds: list[Add] = []
        # how an edited schedule was made (None: a whole new one): the previous
        # schedule's positions dropped (sorted), the handles appended, and the new
        # positions of handles re-added in place
        self.cut, self.appended, self.kept_reset = cut, appended, kept_reset

    @property
    def added_handles(self) -> list[int]:
        return [a[0] for a in self.adds]

    def computed_after(self, hs: list[int], added: dict[int, int] | None = None) -> list[int]:
        """Computed counts of ``hs`` after the advance, before exceptions (``added``:
        the adds' computed counts by handle, if the caller has them)."""
        cols, prev_n = self.state.cols, self.state.nsched
        if added is None:
            added = {h: new.computed for h, new, _, _, _ in self.adds}
        out = []
        for h in hs:
            if h in added:
                out.append(added[h])
            else:
                at = int(cols.pos[h])
                out.append(int(cols.computed[h]) + (int(prev_n[at]) if at >= 0 else 0))
        return out

    def predicted_computed(self) -> I64:
        """Each position's computed count after the advance (SPEC §8.3 step 6, before
        exceptions): what an engine compares its actual counts with."""
        state, new = self.state, self.schedule
        cols, prev, prev_n = state.cols, state.schedule, state.nsched
        if new is prev and not self.reset:
            return cols.computed[new] + prev_n  # type: ignore[no-any-return]
        if self.appended is not None:  # an edited schedule: the kept part, then the tail
            added = {a[0]: a[1].computed for a in self.adds}
            out = edited(cols.computed[prev] + prev_n, self.cut or [],
                         self.computed_after(self.appended, added))
            if self.kept_reset:
                out[self.kept_reset] = [added[h] for h in new[self.kept_reset].tolist()]
            return out  # type: ignore[no-any-return]
        inside = new < cols.capacity
        at = np.full(new.size, -1, dtype=np.int64)
        at[inside] = cols.pos[new[inside]]
        computed = np.zeros(new.size, dtype=np.int64)
        computed[inside] = cols.computed[new[inside]]
        moved = at >= 0
        computed[moved] += prev_n[at[moved]]
        if self.adds and new.size:
            hs = np.asarray(self.added_handles, dtype=np.int64)
            where = np.full(max(int(new.max()), int(hs.max())) + 1, -1, dtype=np.int64)
            where[new] = np.arange(new.size)
            at_new = where[hs]
            found = at_new >= 0
            computed[at_new[found]] = np.asarray([a[1].computed for a in self.adds],
                                                 dtype=np.int64)[found]
        return computed

    def token_lengths(self, new: I64) -> I64:
        """Token history lengths of the new schedule's handles after the adds."""
        cols = self.state.cols
        if not self.adds:  # (only an added handle may lie past the columns)
            return cols.token_len[new]  # type: ignore[no-any-return]
        inside = new < cols.capacity  # (a handle added past the columns has no history)
        length = np.zeros(new.size, dtype=np.int64)
        length[inside] = cols.token_len[new[inside]]
        for h, _, _, _, toks in self.adds:
            length[new == h] = 0 if toks is None else toks.size
        return length  # type: ignore[no-any-return]


def plan_membership(state: StateView, body: DeltaBody, specs: list[Spec] | None,
                    applied: Applied) -> Membership:
    """Steps 1-3 of a body against ``state`` (see the module docstring); InvalidDelta or
    MalformedMessage for a body that does not apply."""
    prev, prev_n, cols = state.schedule, state.nsched, state.cols
    rare = body.rare
    if not (body.finished or body.added or body.schedule_drop or body.schedule_append
            or rare.schedule_full):
        if rare.finished_unknown:
            applied.finished_ids = list(rare.finished_unknown)
        return Membership(state, prev, prev_n, state.advance)
    d = 0
    specs_of = state.specs  # a live handle's spec; None (or beyond the list): not live
    fin = unpack_uint_list(body.finished) if body.finished else []
    if fin:  # 1. finishes
        if len(set(fin)) != len(fin) or max(fin) >= len(specs_of) \
                or any(specs_of[h] is None for h in fin):
            raise InvalidDelta("finished handles must be distinct and live")
        d -= _entry_terms(state, fin)
        applied.finished = fin
        applied.finished_ids = [specs_of[h].req_id for h in fin]  # type: ignore[union-attr]
    if rare.finished_unknown:
        applied.finished_ids = applied.finished_ids + list(rare.finished_unknown)
    adds: list[Add] = []
    if body.added:
        applied.added, applied.specs, applied.prompts = [], [], []
    for k, new in enumerate(body.added):  # 2. adds
        h = new.handle
        if not 0 <= h <= MAX_HANDLE or not 0 <= new.computed <= MAX_COUNT:
            raise InvalidDelta("bad added request", handle=h, computed=new.computed)
        spec = specs[k] if specs is not None else decode_added_spec(new)
        if (new.mm_data and len(spec.mm) != len(new.mm_data)) or (
                new.mm_embed and len(spec.mm) != len(new.mm_embed)):
            raise InvalidDelta("mm data and masks must match the spec's items", handle=h)
        tokens = None
        if state.token_mode == TOKEN_MODE_ENGINE:
            tokens = unpack_uints(new.output) if new.output else np.zeros(0, np.int64)
        elif new.output:
            raise InvalidDelta("tokens in worker-token mode", handle=h)
        adds.append((h, new, spec, dg.spec_term(h, new.spec), tokens))
        applied.added.append(h)
        applied.specs.append(spec)
        applied.prompts.append(None if specs is not None or spec.prompt_none
                               else unpack_uint_list(spec.prompt))
    fin_set, added = set(fin), set(applied.added)
    if len(added) != len(applied.added):
        raise InvalidDelta("added handles must be distinct")
    updates = [h for h in applied.added  # updates: the old entry ends
               if h < len(specs_of) and specs_of[h] is not None and h not in fin_set]
    if updates:
        d -= _entry_terms(state, updates)
    for h, entry, _, term, toks in adds:
        d += term + entry.computed * dg.handle_key(h)
        if toks is not None and toks.size:
            d += dg.total(dg.token_sums(np.array([h]), np.zeros(1, np.int64),
                                        np.array([toks.size]), toks))
    member = _schedule(state, body, fin_set, added, applied)  # 3. the schedule
    member.reset, member.adds = fin_set | added, adds
    applied.schedule_changed = member.schedule is not prev
    d += state.advance
    if member.reset:
        pos, cap = cols.pos, cols.capacity
        for h in member.reset:  # (reset handles do not advance)
            at = int(pos[h]) if h < cap else -1
            if at >= 0:
                d -= int(prev_n[at]) * dg.handle_key(h)
    member.change = d & MASK  # 6a. the previous schedule's survivors advance
    return member


def _entry_terms(state: StateView, handles: list[int]) -> int:
    """The digest terms of these live handles' entries (spec, computed, blocks, tokens)."""
    c = state.cols
    if len(handles) <= dg.SMALL:
        spec_term, computed, token_sum, block_sum = c.spec_term, c.computed, c.token_sum, \
            c.block_sum
        one = block_sum.shape[0] == 1
        total = 0
        for h in handles:
            total += int(spec_term[h]) + int(computed[h]) * dg.handle_key(h) \
                + int(token_sum[h]) + (int(block_sum[0, h]) if one
                                       else sum(block_sum[:, h].tolist()))
        return total & MASK
    hs = np.asarray(handles, dtype=np.int64)
    return (dg.total(c.spec_term[hs]) + dg.keyed_sum(hs, c.computed[hs])
            + dg.total(c.token_sum[hs]) + dg.total(c.block_sum[:, hs].ravel())) & MASK


def _schedule(state: StateView, body: DeltaBody, fin: set[int], added: set[int],
              applied: Applied) -> Membership:
    """The new schedule and each position's predicted count: a kept handle's previous
    count unless it is reset (finished or added in this body), else 1."""
    cols, prev, prev_n = state.cols, state.schedule, state.nsched
    full, drop, append = body.rare.schedule_full, body.schedule_drop, body.schedule_append
    if full:
        if drop or append:
            raise InvalidDelta("schedule_full with schedule_drop/append")
        return _full_schedule(state, unpack_uints(full), fin, added)
    cut = unpack_uint_list(drop) if drop else []
    if cut and (max(cut) >= prev.size or len(set(cut)) != len(cut)):
        raise InvalidDelta("schedule_drop positions must be distinct and in range")
    dropped = set(cut)
    pos, cap = cols.pos, cols.capacity
    kept_reset = []  # previous positions of handles re-added in place
    for h in fin | added:
        at = int(pos[h]) if h < cap else -1
        if at >= 0 and at not in dropped:
            if h not in added:
                raise InvalidDelta("the schedule keeps a finished handle", handle=h)
            kept_reset.append(at)
    if not cut and not append:
        if not kept_reset:
            return Membership(state, prev, prev_n, cut=[], appended=[], kept_reset=[])
        counts = prev_n.copy()
        counts[kept_reset] = 1
        return Membership(state, prev, counts, cut=[], appended=[], kept_reset=kept_reset)
    new_part = unpack_uint_list(append) if append else []
    tail = []  # the appended handles' predicted counts
    specs_of = state.specs
    for h in new_part:
        at = int(pos[h]) if h < cap else -1
        if (h not in added and (h in fin or h >= len(specs_of) or specs_of[h] is None)) \
                or (at >= 0 and at not in dropped):
            raise InvalidDelta("appended handles must be distinct, live and unscheduled",
                               handle=h)
        tail.append(int(prev_n[at]) if at >= 0 and h not in fin and h not in added else 1)
    if len(set(new_part)) != len(new_part):
        raise InvalidDelta("appended handles must be distinct, live and unscheduled")
    applied.dropped, applied.appended = cut, new_part
    ordered = sorted(cut)
    if cut or new_part:
        new, counts = edited(prev, ordered, new_part), edited(prev_n, ordered, tail)
    else:
        new, counts = prev, prev_n
    if kept_reset:
        if cut:
            kept_reset = [at - bisect_left(ordered, at) for at in kept_reset]
        if counts is prev_n:  # an append that unpacks to nothing: prev_n is read-only
            counts = prev_n.copy()
        counts[kept_reset] = 1
    new.flags.writeable = False
    return Membership(state, new, counts, cut=ordered, appended=new_part,
                      kept_reset=kept_reset)


def edited(values: I64, cut: list[int], tail: list[int]) -> I64:
    """``values`` without the positions ``cut`` (sorted, distinct, in range), then
    ``tail``: a fresh int64 array, copied in runs when few positions go."""
    n, k = values.size, len(cut)
    if k > 8:
        keep = np.ones(n, dtype=bool)
        keep[cut] = False
        kept = values[keep]
        return np.concatenate((kept, np.array(tail, dtype=np.int64))) if tail else kept
    out = np.empty(n - k + len(tail), dtype=np.int64)
    at = start = 0
    for c in cut:
        out[at:at + c - start] = values[start:c]
        at += c - start
        start = c + 1
    out[at:n - k] = values[start:]
    if tail:
        out[n - k:] = tail
    return out


def _alive(state: StateView, h: int, fin: set[int], added: set[int]) -> bool:
    """Whether ``h`` is live after the body's finishes and adds."""
    if h in added:
        return True
    return h not in fin and 0 <= h < state.cols.capacity and bool(state.cols.live[h])


def _full_schedule(state: StateView, new: I64, fin: set[int], added: set[int],
                   ) -> Membership:
    cols, prev_n = state.cols, state.nsched
    if new.size and (int(new.min()) < 0 or int(new.max()) > MAX_HANDLE
                     or np.unique(new).size != new.size):
        raise InvalidDelta("the schedule must hold distinct handles")
    inside = new < cols.capacity
    live = np.zeros(new.size, dtype=bool)
    live[inside] = cols.live[new[inside]]
    at = np.full(new.size, -1, dtype=np.int64)
    at[inside] = cols.pos[new[inside]]
    kept = at >= 0
    reset = fin | added
    if reset:
        hit = np.isin(new, np.fromiter(reset, dtype=np.int64, count=len(reset)))
        live[hit] = [_alive(state, h, fin, added) for h in new[hit].tolist()]
        kept &= ~hit
    if not live.all():
        raise InvalidDelta("the schedule must hold live handles")
    counts = np.ones(new.size, dtype=np.int64)
    counts[kept] = prev_n[at[kept]]
    new = new.astype(np.int64, copy=False)
    new.flags.writeable = False
    return Membership(state, new, counts)
