"""Building one Delta body: the engine's full request compared with the mirror state.

Each ``_x`` method produces the part of :class:`DeltaBody` for one concern and
relies on the application order fixed in SPEC.md §8 (finishes, adds, schedule,
tokens, blocks, computed tokens, scheduled tokens, step-only fields).
Predictions that make a steady step free: the schedule repeats, each request's
computed count advances by what it was scheduled, and its scheduled count
repeats; only departures are sent.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress, repeat
from operator import attrgetter, gt, is_
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from engine_side.table_diff import (
    common_prefix,
    members,
    same_prefix,
    same_table,
    table_edits,
)
from protocol.errors import LocalProtocolError
from protocol.messages import TOKEN_MODE_ENGINE, DeltaBody, NewRequest, Rows
from protocol.packing import pack_row_counts, pack_sints, pack_uints
from protocol.rebuild import cached_block_table
from protocol.request import (
    ExecuteModelRequest,
    IntArray,
    Ragged,
    RequestSpec,
    has_duplicates,
    member_mask,
    same_ints,
)

if TYPE_CHECKING:
    from engine_side.mirror import EngineMirror

_EMPTY = np.zeros(0, dtype=np.int64)
_REQ_ID = attrgetter("req_id")
_NO_ROWS = Rows(handles=pack_uints(_EMPTY))  # a Rows entry naming no handle


def _packed(values: IntArray | list[int]) -> bytes:
    return pack_uints(values) if len(values) else b""


class BlockHint(NamedTuple):
    """The caller's word on how a request's block tables differ from the mirror's, so the
    diff compares only the rows it cannot vouch for.

    Rows before ``kept`` hold the mirror's table of their handle with, per KV group,
    ``grown[g]`` -- ascending row positions -- gaining blocks at its end (as many as
    ``added[g]`` says per such row); rows from ``kept`` on are unknown and diffed.  The
    hint is ignored when a kept row's handle restarts in this delta.  A false hint makes
    a false delta: the mirror's ``verify`` mode checks every step against the request.
    """

    kept: int
    grown: tuple[list[int], ...]
    added: tuple[list[int], ...]


class DiffContext:
    """One-shot: holds the intermediate results of diffing one request."""

    def __init__(self, mirror: EngineMirror, request: ExecuteModelRequest,
                 hint: BlockHint | None = None) -> None:
        self.mirror = mirror
        self.state = mirror.state
        self.request = request
        self.hint = hint
        self.fields: dict[str, object] = {}
        self.freed_ids: list[tuple[str, int]] = []
        self.new_ids: list[tuple[str, int]] = []
        self.reset: set[int] = set()  # handles whose history restarts in this delta
        self.handles: IntArray = _EMPTY
        self.added_at: dict[int, int] = {}  # handle -> batch position, for adds
        self._check_shapes()

    def _check_shapes(self) -> None:
        r, n = self.request, len(self.request.req_ids)
        columns = [len(r.specs), r.num_scheduled_tokens.size, r.num_computed_tokens.size,
                   r.spec_token_ids.lengths.size, r.encoder_inputs.lengths.size,
                   *(t.lengths.size for t in r.block_tables)]
        if any(c != n for c in columns) or len(r.block_tables) != self.state.kv_groups:
            raise LocalProtocolError("request columns do not align with req_ids", rows=n)
        tokens = r.output_token_ids
        if (tokens is not None) != (self.state.token_mode == TOKEN_MODE_ENGINE):
            raise LocalProtocolError("output_token_ids must be given iff engine token mode")
        if tokens is not None and len(tokens) != n:
            raise LocalProtocolError("output_token_ids do not align with req_ids", rows=n)

    def build(self) -> DeltaBody:
        """The delta body; a step with nothing but the predicted advance comes out as the
        empty body (the mirror's fast path usually decides that case before this runs)."""
        self._finishes()
        self._schedule_handles()
        self._schedule()
        self._tokens()
        if not self._hint_holds():  # decided once for every KV group
            self.hint = None
        for g in range(self.state.kv_groups):
            self._blocks(g)
        self._computed()
        self._scheduled_tokens()
        self._step_fields()
        return DeltaBody(**self.fields)  # type: ignore[arg-type]

    # -- requests ---------------------------------------------------------------------
    def _finishes(self) -> None:
        self.freed_ids = finish_fields(self.mirror.handles, self.request.finished_req_ids,
                                       self.fields)
        self.reset.update(h for _, h in self.freed_ids)

    def _schedule_handles(self) -> None:
        m, r = self.mirror, self.request
        if not self.reset and r.req_ids == m._last_ids and _same_specs(r.specs, m._last_specs):
            self.handles = m._last_handles
            return
        adds: list[NewRequest] = []
        hs = self._known_handles()
        for i in list(compress(range(len(hs)), map(gt, repeat(0), hs))):  # new, updated, reset
            hs[i] = self._handle_for(i, r.req_ids[i], r.specs[i], adds)
        handles = np.array(hs, dtype=np.int64)
        if has_duplicates(handles):
            raise LocalProtocolError("a request id is scheduled twice")
        self.handles = handles
        if adds:
            self.fields["added"] = tuple(sorted(adds, key=lambda a: a.handle))

    def _known_handles(self) -> list[int]:
        """Per scheduled row, the handle of a live request whose spec is the very object
        the mirror holds, else -1 (:meth:`_handle_for` decides those).  C-level maps: a
        Python call per row costs a microsecond at every general step."""
        m, r = self.mirror, self.request
        if list(map(_REQ_ID, r.specs)) != r.req_ids:  # (columns align: checked at __init__)
            return [-1] * len(r.req_ids)  # _handle_for names the row that disagrees
        hs = list(map(m.handles.get, r.req_ids, repeat(-1)))
        same = map(is_, map(m.engine_specs.get, hs), r.specs)
        out = [h if ok else -1 for h, ok in zip(hs, same, strict=True)]
        clash = self.reset.intersection(out)
        return [-1 if h in clash else h for h in out] if clash else out

    def _handle_for(self, i: int, req_id: str, spec: RequestSpec, adds: list[NewRequest]) -> int:
        if spec.req_id != req_id:
            raise LocalProtocolError("spec.req_id differs from req_ids", req_id=req_id)
        h = self.mirror.handles.get(req_id)
        if h is not None and h not in self.reset:
            known = self.mirror.engine_specs.get(h)
            if known is spec or _spec_equal(known, spec):
                return h
            # an update: same id and handle, new content (the add replaces the entry)
        elif h is None:
            h = self.mirror.allocator.allocate()
        # else: finished in this very step and scheduled again: its handle is reused
        self.reset.add(h)
        self.new_ids.append((req_id, h))
        self.added_at[h] = i
        adds.append(self._new_request(i, h, spec))
        return h

    def _new_request(self, i: int, h: int, spec: RequestSpec) -> NewRequest:
        tokens = self.request.output_token_ids
        return new_request(self.mirror, self.reset, h, spec,
                           int(self.request.num_computed_tokens[i]),
                           _packed(np.asarray(tokens[i])) if tokens is not None else b"")

    # -- schedule ---------------------------------------------------------------------
    def _schedule(self) -> None:
        prev, new = self.state.schedule, self.handles
        if not self.reset and (new is prev or same_ints(prev, new)):
            return
        keep = members(prev, new)
        if self.reset:
            keep &= ~member_mask(prev, self.reset)
        kept = prev[keep]
        if kept.size <= new.size and np.array_equal(kept, new[: kept.size]):
            drop = np.flatnonzero(~keep)
            if drop.size:
                self.fields["schedule_drop"] = pack_uints(drop)
            if new.size > kept.size:
                self.fields["schedule_append"] = pack_uints(new[kept.size:])
        else:
            self.fields["schedule_full"] = pack_uints(new)

    # -- tokens (engine-token mode) -----------------------------------------------------
    def _tokens(self) -> None:
        """Appended tokens and truncations per scheduled row.

        Rows are whole histories, usually only appended to (SPEC §8).  A row at least
        as long as what the workers hold and agrees on all held tokens is taken as
        an append (one vectorised compare); anything else becomes a truncation at
        the first difference plus an append.  ``EngineMirror(verify=True)`` checks
        the whole rebuilt request.
        """
        rows = self.request.output_token_ids
        if rows is None:
            return
        bufs, reset = self.state.tokens, self.reset
        trunc_h: list[int] = []
        trunc_n: list[int] = []
        counts: list[int] = []
        tails: list[IntArray] = []
        for h, row in zip(self.handles.tolist(), rows, strict=True):
            buf = None if h in reset else bufs[h]
            if buf is None:  # a new entry: the add carried the whole history
                counts.append(0)
                continue
            held, size = len(buf), len(row)
            # The whole held prefix must agree: a rewrite may keep the last token.
            if size < held or (held and not same_prefix(buf.view(), row, held)):
                held = common_prefix(buf.view(), np.asarray(row, dtype=np.int64))
                trunc_h.append(h)
                trunc_n.append(held)
            counts.append(size - held)
            if size > held:
                tails.append(row[held:])
        if trunc_h:
            self.fields["truncate"] = Rows(handles=pack_uints(trunc_h), values=pack_uints(trunc_n))
        if tails:
            ones = len(tails) == len(counts) and all(c == 1 for c in counts)
            self.fields["tokens"] = Rows(counts=b"" if ones else pack_uints(counts),
                                         values=pack_uints(np.concatenate(tails)))

    # -- blocks ------------------------------------------------------------------------
    def _old_tables(self, g: int, handles: IntArray | None = None) -> Ragged:
        """The mirror's block tables for the new schedule's handles, or for ``handles``
        (reset ones empty)."""
        state = self.state
        if handles is None:
            handles = self.handles
            if not self.reset and handles is state.schedule:
                return Ragged(*cached_block_table(state, g))
        table = state.blocks[g]
        if not self.reset:
            return Ragged(*table.gather(handles))
        # a handle past the table's rows gathers as an empty row: reset handles are sent there
        past = table.lengths.size
        return Ragged(*table.gather(np.where(member_mask(handles, self.reset), past, handles)))

    def _blocks(self, g: int) -> None:
        new = self.request.block_tables[g]
        last = self.mirror._last_tables
        if g < len(last) and new is last[g] and self.handles is self.state.schedule:
            return  # the very table of the last step, for the same batch: unchanged
        edits = None if self.hint is None else self._hinted_edits(g, new)
        if edits is None:
            old = self._old_tables(g)
            if same_table(old, new):
                return
            replace, append = table_edits(old, new)
            edits = (replace, append, old.lengths[append])
        replace, append, starts = edits
        hs = self.handles
        new_off = new.offsets()
        for name, rows, start in (("block_replace", replace, None), ("block_append", append,
                                                                      starts)):
            if not rows.size:
                continue
            lo = new_off[rows] if start is None else new_off[rows] + start
            hi = new_off[rows + 1]
            values = np.concatenate([new.values[a:b] for a, b in zip(lo, hi, strict=True)])
            entry = Rows(handles=pack_uints(hs[rows]), counts=pack_row_counts(hi - lo),
                         values=pack_uints(values))
            self._group_field(name, g, entry)

    def _hint_holds(self) -> bool:
        hint = self.hint
        return hint is not None and hint.kept <= self.handles.size and not (
            self.reset and member_mask(self.handles[:hint.kept], self.reset).any())

    def _hinted_edits(self, g: int, new: Ragged) -> tuple[IntArray, IntArray, IntArray]:
        """(rows to replace, rows to append to, each appended row's length before) of
        group ``g`` from the hint: its grown rows as it says, the rows past ``kept``
        diffed against the mirror (the same rows, in the same order, as a diff of whole
        tables finds when the hint is true)."""
        hint = self.hint
        assert hint is not None  # noqa: S101 - checked by the caller
        kept, grown = hint.kept, np.array(hint.grown[g], dtype=np.int64)
        starts = new.lengths[grown] - np.array(hint.added[g], dtype=np.int64)
        if kept == self.handles.size:
            return _EMPTY, grown, starts
        old = self._old_tables(g, self.handles[kept:])
        at = int(new.lengths[:kept].sum())
        tail = Ragged(new.lengths[kept:], new.values[at:])
        if same_table(old, tail):
            return _EMPTY, grown, starts
        replace, append = table_edits(old, tail)
        return (replace + kept, np.concatenate([grown, append + kept]),
                np.concatenate([starts, old.lengths[append]]))

    def _group_field(self, name: str, g: int, entry: Rows) -> None:
        groups = self.fields.get(name)
        if groups is None:
            # An untouched group names no rows explicitly: Rows() would mean "every
            # scheduled request" (SPEC §6.2).
            groups = [_NO_ROWS for _ in range(self.state.kv_groups)]
            self.fields[name] = groups
        cast(list[Rows], groups)[g] = entry  # a list until _step_fields freezes it

    # -- token counts ----------------------------------------------------------------------
    def _predicted_computed(self) -> IntArray:
        cols, hs = self.state.cols, self.handles
        known = self._carried_over()
        pred = np.zeros(hs.size, dtype=np.int64)
        pred[known] = cols.computed[hs[known]]
        was = np.zeros(hs.size, dtype=bool)
        was[known] = cols.in_sched[hs[known]]
        pred[was] += cols.last_nsched[hs[was]]
        for i in self.added_at.values():
            pred[i] = int(self.request.num_computed_tokens[i])
        return pred

    def _carried_over(self) -> npt.NDArray[np.bool_]:
        """Mask of scheduled handles whose history carries over (not new in this delta)."""
        hs = self.handles
        known = hs < self.state.cols.capacity
        if self.reset:
            known &= ~member_mask(hs, self.reset)
        return known

    def _computed(self) -> None:
        actual = np.asarray(self.request.num_computed_tokens, dtype=np.int64)
        if actual.size and actual.min() < 0:
            raise LocalProtocolError("negative num_computed_tokens")
        state = self.state
        predicted: IntArray
        if self.handles is state.schedule and not self.reset:  # unchanged batch: advance
            predicted = state.cols.computed[state.schedule] + state.nsched
            if same_ints(actual, predicted):
                return
        else:
            predicted = self._predicted_computed()
        deltas = actual - predicted
        pos = np.flatnonzero(deltas)
        if pos.size:
            self.fields["computed_tokens"] = Rows(handles=pack_uints(pos),
                                                  values=pack_sints(deltas[pos]))

    def _scheduled_tokens(self) -> None:
        cols, hs = self.state.cols, self.handles
        actual = np.asarray(self.request.num_scheduled_tokens, dtype=np.int64)
        if actual.size and actual.min() < 0:
            raise LocalProtocolError("negative num_scheduled_tokens")
        if hs is self.state.schedule and not self.reset and same_ints(actual, self.state.nsched):
            return
        known = self._carried_over()
        known[known] = cols.in_sched[hs[known]]
        pred = np.ones(hs.size, dtype=np.int64)
        pred[known] = cols.last_nsched[hs[known]]
        pos = np.flatnonzero(actual != pred)
        if pos.size:
            self.fields["scheduled_tokens"] = Rows(handles=pack_uints(pos),
                                                   values=pack_uints(actual[pos]))

    # -- step-only fields -----------------------------------------------------------------
    def _step_fields(self) -> None:
        r, f = self.request, self.fields
        for name, ragged in (("spec_tokens", r.spec_token_ids), ("encoder_inputs",
                                                                 r.encoder_inputs)):
            if ragged.values.size or ragged.lengths.any():
                f[name] = Rows(counts=pack_uints(ragged.lengths), values=pack_uints(ragged.values))
        for name, ids in (("preempted", r.preempted_req_ids), ("resumed", r.resumed_req_ids)):
            if ids:
                f[name] = pack_uints(sorted(self._live_handle(i) for i in ids))
        if r.free_encoder_mm_hashes:
            f["free_encoder_mm_hashes"] = tuple(r.free_encoder_mm_hashes)
        if r.blocks_to_zero is not None:
            f["blocks_to_zero"] = pack_uints(np.asarray(r.blocks_to_zero, dtype=np.int64))
        f["has_structured_output"] = r.has_structured_output_requests
        f["pending_structured_output"] = r.pending_structured_output_tokens
        f["num_spec_tokens_to_schedule"] = r.num_spec_tokens_to_schedule
        f["extension"] = dict(r.extension)
        for name in ("block_replace", "block_append"):
            if name in f:
                f[name] = tuple(f[name])  # type: ignore[arg-type]

    def _live_handle(self, req_id: str) -> int:
        h = self.mirror.handles.get(req_id)
        new = dict(self.new_ids)
        if req_id in new:
            return new[req_id]
        if h is None or h in self.reset:
            raise LocalProtocolError("preempted/resumed id is not a live request", req_id=req_id)
        return h


def finish_fields(handles: dict[str, int], finished: Iterable[str],
                  fields: dict[str, object]) -> list[tuple[str, int]]:
    """The body's finished handles (sorted) and unknown finished ids (in id order) into
    ``fields``; returns the (id, handle) pairs the mirror frees, in id order."""
    freed, unknown = [], []
    for req_id in sorted(finished):
        h = handles.get(req_id)
        if h is None:
            unknown.append(req_id)
        else:
            freed.append((req_id, h))
    if freed:
        fields["finished"] = pack_uints(sorted(h for _, h in freed))
    if unknown:
        fields["finished_unknown"] = tuple(unknown)
    return freed


def new_request(mirror: EngineMirror, reset: set[int], h: int, spec: RequestSpec,
                computed: int, output: bytes = b"") -> NewRequest:
    """The add of ``spec`` under handle ``h``; its prompt as a reference into a live
    prompt the workers hold where one shares a long enough prefix (``reset``: handles
    finished or added in this delta, never referenced)."""
    prompt = spec.prompt_token_ids
    prefix_handle, prefix, suffix = prefix_reference(mirror, reset, prompt)
    return NewRequest(
        handle=h, req_id=spec.req_id,
        prompt=pack_uints(suffix) if prompt is not None else b"",
        prefix_handle=prefix_handle, prefix=prefix, prompt_none=prompt is None,
        sampling=spec.sampling, pooling=spec.pooling, lora=spec.lora,
        mm_features=spec.mm_features, prompt_embeds=spec.prompt_embeds,
        prompt_is_token_ids=spec.prompt_is_token_ids, num_computed=computed, output=output)


def prefix_reference(mirror: EngineMirror, reset: set[int],
                     prompt: IntArray | None) -> tuple[int, int, IntArray]:
    """(handle, length, rest): reuse a live prompt's leading tokens the workers hold."""
    from engine_side.mirror import PREFIX_MIN_TOKENS

    if prompt is None or prompt.size < PREFIX_MIN_TOKENS:
        return -1, 0, _EMPTY if prompt is None else prompt
    ref = mirror.prefix_index.get(np.asarray(prompt[:PREFIX_MIN_TOKENS],
                                             dtype=np.int64).tobytes())
    state = mirror.state
    if ref is None or ref in reset or not state.cols.live[ref]:
        return -1, 0, prompt
    source = state.specs[ref].prompt_token_ids  # type: ignore[union-attr]
    n = min(source.size, prompt.size)  # type: ignore[union-attr]
    mismatch = np.flatnonzero(source[:n] != prompt[:n])  # type: ignore[index]
    common = int(mismatch[0]) if mismatch.size else n
    if common < PREFIX_MIN_TOKENS:
        return -1, 0, prompt
    return ref, common, prompt[common:]


def _spec_equal(a: RequestSpec | None, b: RequestSpec) -> bool:
    from protocol.request import _same_value

    return a is not None and _same_value(a, b)


def _same_specs(specs: list[RequestSpec], last: list[RequestSpec]) -> bool:
    """True when every spec is the very object seen last step (C-speed identity check)."""
    try:
        return specs == last
    except (ValueError, TypeError):  # numpy fields make Struct __eq__ ambiguous
        return False
