"""Validate a delta against a state and compute its effects, without mutating anything.

``prepare(state, body)`` is phase one of applying a delta: it decodes every
packed array, checks every handle and length, resolves prefix references and
computes the digest the state *would* have.  Phase two
(:meth:`ReplicaState.commit`) cannot fail.  So a bad delta -- or one whose digest
does not match -- leaves the state exactly as it was.

Application order (SPEC.md §8): finishes, adds, schedule, truncations, token
appends, block replacements, block appends, computed-token advance and
exceptions, scheduled-token prediction and exceptions, step-only fields.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from protocol import digest as dg
from protocol.errors import InvalidDelta
from protocol.messages import TOKEN_MODE_ENGINE, DeltaBody, NewRequest, Rows
from protocol.packing import (
    INT64_MAX,
    unpack_sint_list,
    unpack_sints,
    unpack_uint_list,
    unpack_uints,
)
from protocol.plan_blocks import BlockPlanner, FewAppends, few_appends
from protocol.plan_counts import FEW_ROWS, CountPlanner
from protocol.planned import (  # re-exported: the plan's parts live in protocol.planned
    _EMPTY,
    STEADY_BODY,
    Added,
    BlockEdit,
    Plan,
    StepInfo,
    TokenRows,
    _empty_rows,
    _read_only,
    advance_delta,
    encode_spec_for_hash,
    steady_step,
)
from protocol.request import IntArray, Ragged, RequestSpec, has_duplicates

if TYPE_CHECKING:
    from protocol.state import ReplicaState

__all__ = ["STEADY_BODY", "Added", "BlockEdit", "Plan", "StepInfo", "TokenRows",
           "advance_delta", "encode_spec_for_hash", "prepare", "prepare_appends", "steady_step",
           "FewAppends", "few_appends", "lane_step"]


#: added requests up to this many gain their digest terms one by one; more, by columns
FEW_ADDED = 16


def _ints(buf: bytes) -> IntArray:
    return unpack_uints(buf) if buf else _EMPTY


class _Planner(BlockPlanner, CountPlanner):
    """One-shot helper holding the intermediate views of a delta being prepared."""

    def __init__(self, state: ReplicaState, body: DeltaBody) -> None:
        self.state = state
        self.body = body
        # copied on first write (_own_live): most deltas add nothing
        self.live = state.lazy_cols.live
        self._live_owned = False
        self.reset: set[int] = set()  # handles finished or (re)added: no history carried over
        self.truncated_sums: dict[int, int] = {}  # handle -> digest terms removed
        self.appended: dict[int, tuple[IntArray, IntArray, IntArray]] = {}  # group -> rows
        self.digest = state.digest
        self.advance: int | None = None  # advance term of a changed nsched (same schedule)
        #: (schedule, nsched, schedule term) of a new schedule (the state caches it)
        self.schedule_term: tuple[IntArray, IntArray, int] | None = None

    def _own_live(self) -> None:
        if not self._live_owned:
            self.live, self._live_owned = self.live.copy(), True

    def fail(self, message: str, **fields: object) -> InvalidDelta:
        return InvalidDelta(message, **fields)

    # -- liveness ---------------------------------------------------------------
    def check_live(self, handles: IntArray, what: str) -> None:
        if handles.size == 0:
            return
        if handles.size <= dg.SMALL:  # scalar reads beat numpy's fixed costs
            hs, live = handles.tolist(), self.live
            if max(hs) < live.size and all(map(live.item, hs)):
                return
        elif handles.max() < self.live.size and self.live[handles].all():
            return
        raise self.fail(f"{what} names a handle that is not live", handles=handles.tolist()[:8])

    def drop_terms(self, h: int) -> None:
        """Subtract every digest term of live handle ``h`` (finish or replace)."""
        cols = self.state.cols
        sums = cols.block_sum
        lost = cols.spec_term.item(h) + cols.token_sum.item(h) + \
            sum(sums.item(g, h) for g in range(sums.shape[0]))
        lost += dg.handle_key_int(h) * cols.computed.item(h)
        self.digest = (self.digest - lost) & dg.MASK

    def finishes(self) -> IntArray:
        finished = _ints(self.body.finished)
        if has_duplicates(finished):
            raise self.fail("finished handles repeat")
        self.check_live(finished, "finished")
        for h in finished.tolist():
            self.drop_terms(h)
            self._own_live()
            self.live[h] = False
            self.reset.add(h)
        return finished

    def adds(self) -> list[Added]:
        out: list[Added] = []
        seen: set[int] = set()
        for new in self.body.added:
            if new.handle < 0 or new.handle > 1 << 24 or new.handle in seen:
                raise self.fail("bad or repeated add handle", handle=new.handle)
            seen.add(new.handle)
            if new.handle < self.live.size and self.live[new.handle]:
                self.drop_terms(new.handle)  # a new entry for a live handle is an update
            out.append(self._resolve_add(new))
        self._mark_added(out)
        return out

    def _mark_added(self, added: list[Added]) -> None:
        """The added handles live and reset, their digest terms gained: scalar terms for
        a few, column terms for more (a batch that joins together)."""
        if not added:
            return
        self._own_live()
        hs = [a.handle for a in added]
        top = max(hs)
        if top >= self.live.size:
            self.live = np.concatenate([self.live, np.zeros(top + 1 - self.live.size, bool)])
        self.reset.update(hs)
        computed = [a.computed for a in added]
        # (a count past int64, which numpy cannot hold, takes the one-by-one lines)
        if len(added) <= FEW_ADDED or max(computed) > INT64_MAX:
            gained = sum(dg.spec_term_int(a.handle, a.spec_hash)
                         + dg.handle_key_int(a.handle) * a.computed for a in added)
            for h in hs:
                self.live[h] = True
        else:
            at = np.array(hs, dtype=np.int64)
            self.live[at] = True
            gained = dg.total(dg.spec_terms(at, [a.spec_hash for a in added])) + \
                dg.total(dg.computed_terms(at, computed))
        for a in added:
            if a.tokens is not None:
                pos = np.arange(a.tokens.size)
                gained += dg.total(dg.token_terms(np.full(pos.size, a.handle), pos, a.tokens))
        self.digest = (self.digest + gained) & dg.MASK

    def _resolve_add(self, new: NewRequest) -> Added:
        prompt: IntArray | None = None
        if not new.prompt_none:
            prompt = _ints(new.prompt)
            if new.prefix_handle >= 0:
                prompt = np.concatenate([self._prefix(new), prompt])
            prompt.flags.writeable = False
        elif new.prompt or new.prefix_handle >= 0:
            raise self.fail("prompt_none request carries prompt tokens", handle=new.handle)
        spec = RequestSpec(new.req_id, prompt, new.sampling, new.pooling, new.lora,
                           tuple(new.mm_features), new.prompt_embeds, new.prompt_is_token_ids)
        tokens = _ints(new.output) if self.state.token_mode == TOKEN_MODE_ENGINE else None
        if tokens is None and new.output:
            raise self.fail("output tokens in worker-owned token mode", handle=new.handle)
        if new.num_computed < 0:
            raise self.fail("negative computed tokens", handle=new.handle)
        try:
            h = dg.spec_hash(encode_spec_for_hash(spec))
        except (TypeError, ValueError) as exc:  # e.g. prompt_embeds that is not a tensor
            raise self.fail("request content cannot be hashed", handle=new.handle,
                            cause=str(exc)[:100]) from exc
        return Added(new.handle, spec, h, new.num_computed, tokens)

    def _prefix(self, new: NewRequest) -> IntArray:
        ref = new.prefix_handle
        specs = self.state.specs
        if ref >= self.live.size or not self.live[ref] or ref in self.reset:
            raise self.fail("prefix reference to a handle that is not live", handle=ref)
        source = specs[ref].prompt_token_ids  # type: ignore[union-attr]
        if source is None or not 0 < new.prefix <= source.size:
            raise self.fail("prefix reference out of range", handle=ref, length=new.prefix)
        return source[: new.prefix]

    # -- schedule ---------------------------------------------------------------
    def schedule(self) -> IntArray:
        body, prev = self.body, self.state.schedule
        sched: IntArray
        if not (body.schedule_full or body.schedule_drop or body.schedule_append or self.reset):
            return prev  # unchanged and already validated when it was installed
        if body.schedule_full:
            if body.schedule_drop or body.schedule_append:
                raise self.fail("full schedule combined with schedule edits")
            sched = unpack_uints(body.schedule_full)
        elif prev.size <= FEW_ROWS:
            sched = self._few_edits(prev)
        else:
            drop = _ints(body.schedule_drop)
            if drop.size and (drop.max() >= prev.size or has_duplicates(drop)):
                raise self.fail("schedule drop position out of range")
            keep = np.ones(prev.size, dtype=bool)
            keep[drop] = False
            sched = np.concatenate([prev[keep], _ints(body.schedule_append)])
            if not drop.size and not body.schedule_append:
                sched = prev  # steady state: the same array, no allocation
        if sched is prev and not self.reset:
            return sched  # unchanged and already validated when it was installed
        if has_duplicates(sched):
            raise self.fail("schedule repeats a handle")
        self.check_live(sched, "schedule")
        return sched

    def _few_edits(self, prev: IntArray) -> IntArray:
        """The schedule after a body's drop and append edits of a few rows (Python ints;
        the same checks)."""
        body = self.body
        drop = unpack_uint_list(body.schedule_drop) if body.schedule_drop else []
        rows = prev.tolist()
        if drop and (max(drop) >= len(rows) or len(set(drop)) != len(drop)):
            raise self.fail("schedule drop position out of range")
        if not drop and not body.schedule_append:
            return prev  # (an empty packed drop) the same array, as the numpy path keeps it
        for p in sorted(drop, reverse=True):
            del rows[p]
        if body.schedule_append:
            rows += unpack_uint_list(body.schedule_append)
        return np.array(rows, dtype=np.int64)

    def rows(self, rows: Rows, sched: IntArray, signed: bool = False) -> tuple[IntArray, IntArray,
                                                                             IntArray]:
        """Decode a Rows field to (handles, counts, values), checking its shape."""
        handles = _ints(rows.handles) if rows.handles else sched
        counts = _ints(rows.counts) if rows.counts else np.ones(handles.size, dtype=np.int64)
        values = (unpack_sints(rows.values) if signed else _ints(rows.values))
        if counts.size != handles.size or int(counts.sum()) != values.size:
            raise self.fail("rows shape mismatch", rows=handles.size, counts=counts.size,
                            values=values.size)
        return handles, counts, values

    def positions(self, rows: Rows | None, sched: IntArray, signed: bool) -> tuple[IntArray,
                                                                                  IntArray]:
        """Decode (schedule positions, values) exceptions."""
        if rows is None:
            return _EMPTY, _EMPTY
        pos = _ints(rows.handles)
        vals = unpack_sints(rows.values) if signed else _ints(rows.values)
        if pos.size != vals.size or (pos.size and pos.max() >= sched.size):
            raise self.fail("exception positions out of range")
        if has_duplicates(pos):
            raise self.fail("exception positions repeat")
        return pos, vals

    def exceptions(self, rows: Rows, n: int, signed: bool) -> tuple[list[int], list[int]]:
        """:meth:`positions` as Python lists (the same checks), against ``n`` positions."""
        pos = unpack_uint_list(rows.handles) if rows.handles else []
        vals = (unpack_sint_list(rows.values) if signed
                else unpack_uint_list(rows.values) if rows.values else [])
        if len(pos) != len(vals) or (pos and max(pos) >= n):
            raise self.fail("exception positions out of range")
        if len(set(pos)) != len(pos):
            raise self.fail("exception positions repeat")
        return pos, vals

    # -- tokens -----------------------------------------------------------------
    def tokens(self, sched: IntArray, added: list[Added]) -> tuple[dict[int, int],
                                                                 TokenRows | None]:
        body, state = self.body, self.state
        if state.token_mode != TOKEN_MODE_ENGINE:
            if body.truncate is not None or body.tokens is not None:
                raise self.fail("token fields in worker-owned token mode")
            return {}, None
        new_len = {a.handle: a.tokens.size for a in added if a.tokens is not None}
        current = {}

        def length(h: int) -> int:
            if h not in current:
                buf = state.tokens[h] if h < len(state.tokens) else None
                current[h] = new_len.get(h, len(buf) if buf is not None else 0)
            return current[h]

        truncate: dict[int, int] = {}
        if body.truncate is not None:
            hs, _, lens = self.rows(body.truncate, sched)
            self.check_live(hs, "truncate")
            for h, n in zip(hs.tolist(), lens.tolist(), strict=True):
                if n > length(h) or h in truncate:
                    raise self.fail("truncation beyond history", handle=h, length=n)
                self.drop_token_range(h, n, length(h), added)
                truncate[h] = current[h] = n
        return truncate, self._token_appends(sched, length, current)

    def drop_token_range(self, h: int, start: int, end: int, added: list[Added]) -> None:
        fresh = next((a.tokens for a in added if a.handle == h), None)
        source = fresh if fresh is not None else self.state.tokens[h].view()  # type: ignore
        gone = source[start:end]
        lost = dg.total(dg.token_terms(np.full(gone.size, h), np.arange(start, end), gone))
        self.truncated_sums[h] = lost
        self.digest = (self.digest - lost) & dg.MASK

    def _token_appends(self, sched: IntArray, length: object, current: dict[int, int]
                       ) -> TokenRows | None:
        if self.body.tokens is None:
            return None
        hs, counts, values = self.rows(self.body.tokens, sched)
        self.check_live(hs, "tokens")
        if hs is not sched and has_duplicates(hs):
            raise self.fail("token rows repeat a handle")
        starts = np.fromiter((length(h) for h in hs.tolist()), dtype=np.int64,  # type: ignore
                             count=hs.size)
        offsets = np.zeros(hs.size + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        row = np.repeat(np.arange(hs.size), counts)
        pos = starts[row] + (np.arange(values.size) - offsets[row])
        cum = np.zeros(values.size + 1, dtype=np.uint64)
        np.cumsum(dg.token_terms(hs[row], pos, values), out=cum[1:])
        sums = cum[offsets[1:]] - cum[offsets[:-1]]
        self.digest = (self.digest + int(cum[-1])) & dg.MASK
        return TokenRows(hs, counts, values, offsets, sums)


    # -- step-only fields ---------------------------------------------------------
    def step(self, sched: IntArray, finished: IntArray) -> StepInfo:
        body, specs = self.body, self.state.specs
        ids = {specs[h].req_id for h in finished.tolist()}  # type: ignore[union-attr]
        preempted, resumed = _ints(body.preempted), _ints(body.resumed)
        self.check_live(preempted, "preempted")
        self.check_live(resumed, "resumed")
        return StepInfo(
            finished_ids=frozenset(ids | set(body.finished_unknown)),
            preempted=preempted, resumed=resumed,
            spec_tokens=self.aligned(body.spec_tokens, sched),
            encoder_inputs=self.aligned(body.encoder_inputs, sched),
            free_encoder_mm_hashes=tuple(body.free_encoder_mm_hashes),
            blocks_to_zero=_ints(body.blocks_to_zero) if body.blocks_to_zero else None,
            has_structured_output=body.has_structured_output,
            pending_structured_output=body.pending_structured_output,
            num_spec_tokens_to_schedule=body.num_spec_tokens_to_schedule,
            extension=dict(body.extension),
        )

    def aligned(self, rows: Rows | None, sched: IntArray) -> Ragged:
        if rows is None:
            return _empty_rows(self.state, sched.size)
        if rows.handles:
            raise self.fail("schedule-aligned rows must not name handles")
        counts = _ints(rows.counts) if rows.counts else np.ones(sched.size, dtype=np.int64)
        values = _ints(rows.values)
        # np.add.reduce: counts.sum() adds a Python-level wrapper (a microsecond a call)
        if counts.size != sched.size or int(np.add.reduce(counts)) != values.size:
            raise self.fail("schedule-aligned rows shape mismatch")
        return _read_only(Ragged(counts, values))



Appended = dict[int, tuple[IntArray, IntArray, IntArray]]  # group -> (handles, counts, values)


def prepare_appends(state: ReplicaState, body: DeltaBody,
                    ) -> tuple[list[BlockEdit], Appended, int]:
    """The block part of :func:`prepare` for a body that keeps the schedule and adds
    nothing: (edits, appended rows per group, digest after them -- the steady advance
    not included).  The same checks and errors; nothing is mutated."""
    p = _Planner(state, body)
    edits = p.blocks(state.schedule)
    return edits, p.appended, p.digest


def lane_step(state: ReplicaState, body: DeltaBody, steady: StepInfo,
              finished: frozenset[str] = frozenset()) -> StepInfo:
    """The step fields of a lane-shaped body (:mod:`protocol.lane`, which checked its
    speculative rows) that finished ``finished`` (:mod:`protocol.lane_drop`):
    ``steady``'s with the body's own."""
    return dataclasses.replace(
        steady, finished_ids=finished,
        spec_tokens=_Planner(state, body).aligned(body.spec_tokens, state.schedule),
        has_structured_output=body.has_structured_output,
        pending_structured_output=body.pending_structured_output,
        num_spec_tokens_to_schedule=body.num_spec_tokens_to_schedule,
        extension=dict(body.extension))


def prepare(state: ReplicaState, body: DeltaBody) -> Plan:
    """Decode and check ``body`` against ``state``; nothing is mutated.

    Raises InvalidDelta (or MalformedMessage for a bad packed array).
    """
    p = _Planner(state, body)
    finished = p.finishes()
    added = p.adds()
    sched = p.schedule()
    truncate, token_rows = p.tokens(sched, added)
    blocks = p.blocks(sched)
    comp_h, comp_v = p.computed(sched, added)
    nsched = p.nsched(sched)
    step = p.step(sched, finished)
    plan = Plan(finished, added, sched, nsched, truncate, token_rows, blocks, comp_h, comp_v,
                step, p.digest)
    plan.appended = p.appended if not p.reset and not body.block_replace else {}  # type: ignore[attr-defined]
    plan.truncated_sums = p.truncated_sums  # type: ignore[attr-defined]
    plan.advance = p.advance  # type: ignore[attr-defined]
    plan.schedule_term = p.schedule_term  # type: ignore[attr-defined]
    return plan
