"""Whole requests into the mirror: :class:`RequestDiffer` finds what one changed.

A convenience for engines that build a whole :class:`ExecuteModelRequest` each step
(and the tests' oracle): it compares the request with the mirror's state row by row
-- O(scheduled requests and their blocks) -- and hands what changed to
:meth:`EngineMirror.step`.  Engines that know their changes call ``step`` directly.
"""

from __future__ import annotations

import operator
from typing import Any

import msgspec
import numpy as np

from engine_side.mirror import BlockRows, EngineMirror, Entry
from protocol.columns import I64, RowTable
from protocol.errors import LocalProtocolError
from protocol.messages import TOKEN_MODE_ENGINE, Delta
from protocol.rebuild import ragged_rows, request_spec, wire_spec
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, _same_value

_EXT_ENCODER = msgspec.msgpack.Encoder()


def _row(rows: BlockRows, p: int, ids: list[int]) -> None:
    rows[0].append(p)
    rows[1].append(len(ids))
    rows[2].extend(ids)


class RequestDiffer:
    """``diff(request)``: the Delta taking ``mirror`` to a whole request (the mirror must
    keep its tables); remembers the engine's RequestSpec objects (the same object again
    is unchanged, without comparing) while the mirror moves only through it: a step
    taken some other way (``mirror.step``) makes it forget them."""

    def __init__(self, mirror: EngineMirror) -> None:
        self.mirror = mirror
        self.specs: dict[int, RequestSpec] = {}
        self._added: list[RequestSpec] = []  # the last diff's joining specs
        self._seq = mirror.seq  # the mirror's seq when ``specs`` was last right

    def diff(self, request: ExecuteModelRequest) -> Delta:
        """The step's Delta, applied to the mirror; LocalProtocolError (mirror unchanged)
        for an inconsistent request."""
        return self.step(self.changes(request))

    def changes(self, request: ExecuteModelRequest) -> dict[str, Any]:
        """What ``request`` changed: the :meth:`EngineMirror.step` arguments (the mirror
        unchanged); hand them to :meth:`step` before the mirror moves otherwise."""
        if self._seq != self.mirror.seq:
            self.specs.clear()
        return request_changes(self, request)

    def step(self, changes: dict[str, Any]) -> Delta:
        """The Delta of :meth:`changes`' result, applied to the mirror (what an engine
        that knows its changes calls: ``mirror.step``), keeping the specs remembered."""
        delta, applied = self.mirror.step(**changes)
        self._seq = self.mirror.seq
        for h in applied.finished:
            self.specs.pop(h, None)
        for h, spec in zip(applied.added, self._added, strict=True):
            self.specs[h] = spec
        return delta


def request_changes(differ: RequestDiffer, r: ExecuteModelRequest) -> dict[str, Any]:
    """The :meth:`EngineMirror.step` keyword arguments that take the mirror to ``r``."""
    mirror = differ.mirror
    state, ids = mirror.state, mirror.ids
    n = len(r.req_ids)
    if len(set(r.req_ids)) != n or r.num_scheduled_tokens.size != n \
            or r.num_computed_tokens.size != n or len(r.specs) != n:
        raise LocalProtocolError("request columns do not align with its ids", requests=n)
    finished = set(r.finished_req_ids)
    added, fresh = [], set()
    differ._added = []
    handles = list(map(ids.get, r.req_ids))
    specs = differ.specs
    held = [None if h is None else specs.get(h) for h in handles]  # (None: not held)
    same = list(map(operator.is_, held, r.specs))
    for i in ([] if all(same) and finished.isdisjoint(r.req_ids) else range(n)):
        rid, spec, h = r.req_ids[i], r.specs[i], handles[i]
        if h is not None and rid not in finished and (same[i] or _same_spec(differ, h, spec)):
            continue
        wire, data, masks, embeds = wire_spec(spec)
        history = None
        if state.token_mode == TOKEN_MODE_ENGINE:
            history = np.asarray(r.output_token_ids[i] if r.output_token_ids is not None
                                 else [], dtype=np.int64)
        added.append(Entry(wire, int(r.num_computed_tokens[i]), history, data, masks, embeds))
        fresh.add(rid)
        differ._added.append(spec)
    groups = state.kv_groups
    if len(r.block_tables) != groups:
        raise LocalProtocolError("one block table per KV group", groups=groups)
    if state.tables is None:
        raise LocalProtocolError("diffing whole requests needs a mirror that keeps tables")
    hs = np.fromiter((-1 if h is None or rid in fresh else h
                      for rid, h in zip(r.req_ids, handles, strict=True)), np.int64, n)
    appends: list[BlockRows | None] = []
    replaces: list[BlockRows | None] = []
    for g, table in enumerate(r.block_tables):
        app, rep = _block_changes(state.tables[g], hs, table)
        appends.append(app)
        replaces.append(rep)
    token_rows: BlockRows | None = None
    truncate: tuple[list[int], list[int]] | None = None
    if state.token_mode == TOKEN_MODE_ENGINE and r.output_token_ids is not None:
        token_rows, truncate = _token_rows(mirror, r, fresh)
    live = set(ids) - finished | fresh
    for name in (*r.preempted_req_ids, *r.resumed_req_ids):
        if name not in live:
            raise LocalProtocolError("preempted or resumed id is not live", req_id=name)
    return dict(
        batch=list(r.req_ids), nsched=r.num_scheduled_tokens.tolist(), finished=finished,
        added=added, computed=r.num_computed_tokens.tolist(), appends=appends,
        replaces=replaces, tokens=token_rows, truncate=truncate,
        spec_tokens=ragged_rows(r.spec_token_ids, 1),
        encoder_inputs=ragged_rows(r.encoder_inputs), preempted=r.preempted_req_ids,
        resumed=r.resumed_req_ids, free_encoder_mm_hashes=tuple(r.free_encoder_mm_hashes),
        blocks_to_zero=None if r.blocks_to_zero is None else r.blocks_to_zero.tolist(),
        structured=r.has_structured_output_requests,
        pending=r.pending_structured_output_tokens, num_spec=r.num_spec_tokens_to_schedule,
        extension=_EXT_ENCODER.encode(r.extension) if r.extension else b"")


def _same_spec(differ: RequestDiffer, h: int, spec: RequestSpec) -> bool:
    held = differ.specs.get(h)
    if held is spec:
        return True
    state = differ.mirror.state
    same = held is not None and _same_value(held, spec) or _same_value(
        request_spec(state.spec_of(h), state.requests[h]), spec)  # type: ignore[arg-type]
    if same:
        differ.specs[h] = spec
    return same


def _block_changes(held: RowTable, hs: I64, table: Ragged,
                   ) -> tuple[BlockRows | None, BlockRows | None]:
    """(appended, replaced) rows taking the ``held`` tables of handles ``hs`` (-1: a
    request added this step, holding none) to ``table``, by position: a row whose held
    ids are a prefix of its new ones appends the rest, any other changed row is replaced."""
    n = hs.size
    new_len = np.asarray(table.lengths, dtype=np.int64)
    if new_len.size != n:
        raise LocalProtocolError("a block table is not one row per request", rows=new_len.size)
    held_len, held_flat = held.gather(np.where(hs >= 0, hs, held.lengths.size))
    off = table.offsets()
    k = np.minimum(held_len, new_len)  # the prefix both have
    rows = np.repeat(np.arange(n), k)
    within = np.arange(rows.size) - np.repeat(np.cumsum(k) - k, k)
    held_off = np.cumsum(held_len) - held_len
    differs = table.values[off[:-1][rows] + within] != held_flat[held_off[rows] + within]
    replaced = new_len < held_len
    replaced[rows[differs]] = True
    appended = ~replaced & (new_len > held_len)
    return (_rows_of(table, off, np.flatnonzero(appended), held_len),
            _rows_of(table, off, np.flatnonzero(replaced), None))


def _rows_of(table: Ragged, off: Any, at: I64, skip: I64 | None) -> BlockRows | None:
    """Rows ``at`` of ``table`` (from their ``skip``-th id on) as BlockRows; None: none."""
    if not at.size:
        return None
    starts = off[at] if skip is None else off[at] + skip[at]
    counts = off[at + 1] - starts
    flat = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
    values = np.asarray(table.values, dtype=np.int64)[flat]
    return at.tolist(), counts.tolist(), values.tolist()


def _token_rows(mirror: EngineMirror, r: ExecuteModelRequest, fresh: set[str],
                ) -> tuple[BlockRows | None, tuple[list[int], list[int]] | None]:
    """(tokens appended, histories truncated) by schedule position."""
    state, ids = mirror.state, mirror.ids
    app: BlockRows = ([], [], [])
    cut: tuple[list[int], list[int]] = ([], [])
    for p, rid in enumerate(r.req_ids):
        if rid in fresh:
            continue
        old = state.token_history(ids[rid]).tolist()
        new = np.asarray(r.output_token_ids[p]).tolist()  # type: ignore[index]
        keep = len(old) if new[:len(old)] == old else \
            next(i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b) \
            if any(a != b for a, b in zip(old, new, strict=False)) else min(len(old), len(new))
        if keep < len(old):
            cut[0].append(p)
            cut[1].append(keep)
        if len(new) > keep:
            _row(app, p, new[keep:])
    return (app if app[0] else None), (cut if cut[0] else None)
