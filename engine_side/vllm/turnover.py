"""Batch turnover: the general step where requests leave and new ones join, encoded
without building the whole request.

Theory of operation
-------------------
Under continuous batching most steps that are not same-batch steps have one shape:
some requests of the last batch leave it (finished, preempted or just not scheduled),
the rest stay in their order, and new requests join at the end.  For that shape the
general path's body (``ExecuteModelRequest`` → ``EngineMirror.diff``) is known
without comparing whole block tables and count columns: the finished handles, the
adds, a schedule drop and append, the stayers' count departures from the mirror's
prediction, their appended blocks and the new requests' tables, the drafts, the
preempted handles, and the step's extension.  :func:`turnover_delta` builds exactly
that body -- the same fields, the same bytes (the tests compare the two paths on
generated streams) -- and the mirror applies it as the general path does.

Anything else -- a resumed request, a reordered batch, an id that is live again,
drafts out of batch order, multimodal or connector fields, several KV groups, a
store, the mirror's ``verify`` mode -- returns None before anything changes, and the
general path runs (and raises what it raises).

Contract: the encoder calls it only after a general or same-batch step has set its
:class:`~engine_side.vllm.quick.QuickEncoder` (the last batch and its handles).
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, not_
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from engine_side.diffing import finish_fields, new_request
from engine_side.vllm.convert import draft_rows
from engine_side.vllm.params import new_request_spec
from engine_side.vllm.quick import CountRows, count_rows_py
from engine_side.vllm.rare import JOINS_AND_LEAVES, RARE_FIELDS
from engine_side.vllm.schema import StepExt
from protocol import codec
from protocol.codec import Frame
from protocol.messages import DeltaBody, NewRequest, Rows
from protocol.packing import pack_row_counts, pack_uints, pack_uints_plus_one
from protocol.request import RequestSpec
from protocol.speedups import C as _C

if TYPE_CHECKING:
    from engine_side.vllm.encoder import SchedulerOutputEncoder

# The fields a turnover step leaves as a plain step has them, read by one C call and
# compared with one tuple (new requests, finishes and preemptions are the step's own).
_RARE = attrgetter(*(name for name, _ in RARE_FIELDS[JOINS_AND_LEAVES:]))
_PLAIN: tuple[Any, ...] = tuple(value for _, value in RARE_FIELDS[JOINS_AND_LEAVES:])


class _Step:
    """A turnover step's lists, checked (see :func:`_shape`)."""

    def __init__(self, so: Any, stay_at: list[int], handles: list[int], batch: list[str],
                 appends: tuple[list[int], list[int], list[int], list[int]],
                 drafts: tuple[list[int], list[int]] | None) -> None:
        cached = so.scheduled_cached_reqs
        self.new_reqs: list[Any] = so.scheduled_new_reqs
        self.stay: list[str] = cached.req_ids
        self.stay_at = stay_at  # each stayer's position in the last batch (increasing)
        self.handles = handles  # the stayers' handles
        self.batch = batch
        self.nsched: list[int] = list(so.num_scheduled_tokens.values())
        self.computed: list[int] = [*cached.num_computed_tokens,
                                    *(nr.num_computed_tokens for nr in self.new_reqs)]
        #: the stayers' new blocks: (positions, counts, flat ids, positions sending ([],))
        self.appends = appends
        self.outputs: list[int] = cached.num_output_tokens
        self.drafts = drafts  # (tokens per batch position, flat tokens); None: no drafts


def turnover_delta(enc: SchedulerOutputEncoder, so: Any) -> list[Frame] | None:
    """The frames of ``so`` when it is a turnover step, the mirror and the encoder's
    memory advanced as the general path advances them; None, nothing changed, for any
    other step."""
    step = _shape(enc, so)
    if step is None:
        return None
    enc.lane.settle()  # type: ignore[union-attr]
    enc._file_blocks()
    return _encode(enc, so, step)


def _shape(enc: SchedulerOutputEncoder, so: Any) -> _Step | None:
    """The step's lists when ``so`` is a turnover step the fast path takes, else None.
    (The stayers' handles and specs are the mirror's by construction: the quick
    encoder was reset with the schedule of the step that last changed it.)"""
    quick, mirror = enc.quick, enc.mirror
    if not quick.ready or mirror is None or enc.items is not None or enc.kv_groups != 1 \
            or mirror.verify or _RARE(so) != _PLAIN or so.preempted_req_ids is None:
        return None
    cached, new_reqs = so.scheduled_cached_reqs, so.scheduled_new_reqs
    stay, batch = cached.req_ids, list(so.num_scheduled_tokens)
    n = len(stay)
    if batch[:n] != stay or len(batch) != n + len(new_reqs) or \
            (not new_reqs and n == len(quick.batch)):
        return None  # reordered, or not a turnover (the same batch)
    stay_at = list(map(quick.pos.get, stay, repeat(-1)))
    if stay_at and (min(stay_at) < 0 or stay_at != sorted(stay_at)):
        return None  # a stayer the last batch did not hold, or out of its order
    if not _joining_fits(enc, so, batch[n:]):
        return None
    appends = _appends(cached.new_block_ids)
    if appends is None or not (len(cached.new_block_ids) == len(cached.num_computed_tokens)
                               == len(cached.num_output_tokens) == n):
        return None
    drafts = None
    if so.scheduled_spec_decode_tokens:  # rows in batch order, or the general path
        drafts = draft_rows(so.scheduled_spec_decode_tokens,
                            dict(zip(batch, range(len(batch)), strict=True)), len(batch))
        if drafts is None or min(drafts[1]) < -1:
            return None
    step = _Step(so, stay_at, list(map(quick.handles.__getitem__, stay_at)), batch, appends,
                 drafts)
    if so.total_num_scheduled_tokens != sum(step.nsched) or \
            min(step.nsched, default=0) < 0 or min(step.computed, default=0) < 0:
        return None
    return step


def _joining_fits(enc: SchedulerOutputEncoder, so: Any, joining: list[str]) -> bool:
    """The new requests are ``joining`` in order, none live, none finished or preempted,
    each of one KV group without multimodal inputs, embeddings or prefill tokens; the
    preempted requests are live."""
    mirror = enc.mirror
    assert mirror is not None  # noqa: S101 - checked by the caller
    new_reqs, finished, preempted = so.scheduled_new_reqs, set(so.finished_req_ids), \
        set(so.preempted_req_ids)
    if [nr.req_id for nr in new_reqs] != joining or len(set(joining)) != len(joining) \
            or any(r in enc.specs or r in mirror.handles for r in joining):
        return False  # out of order, or an id live again (an update: the general path)
    if not finished.isdisjoint(so.num_scheduled_tokens) or \
            not preempted.isdisjoint(so.num_scheduled_tokens) or \
            not all(r in mirror.handles and r not in finished for r in preempted):
        return False
    return all(nr.prefill_token_ids is None and not nr.mm_features
               and nr.prompt_embeds is None and len(nr.block_ids) == 1 for nr in new_reqs)


def _appends(new_blocks: Any) -> tuple[list[int], list[int], list[int], list[int]] | None:
    """(positions, counts, flat ids, empty positions) of a one-group step's new blocks --
    each entry None or one group's list -- the empty positions sending ``([],)``; None
    for any other entry."""
    got = _C.one_group_appends(new_blocks) if _C is not None else None
    if got is not None:
        return (*got, [])
    if type(new_blocks) is not list:
        return None
    pos: list[int] = []
    counts: list[int] = []
    flat: list[int] = []
    empty: list[int] = []
    for k, entry in enumerate(new_blocks):
        if entry is None:
            continue
        if type(entry) not in (tuple, list) or len(entry) != 1 or \
                type(entry[0]) not in (tuple, list):
            return None
        if entry[0]:
            pos.append(k)
            counts.append(len(entry[0]))
            flat += entry[0]
        else:
            empty.append(k)
    return pos, counts, flat, empty


def _encode(enc: SchedulerOutputEncoder, so: Any, step: _Step) -> list[Frame]:
    """The step's frames; the encoder's memory and the mirror advanced (the general
    path's order: finishes, new requests, cached requests, the body, the mirror)."""
    mirror, mem = enc.mirror, enc.mem
    assert mirror is not None and enc.lane is not None  # noqa: S101 - checked by _shape
    fields: dict[str, Any] = {}
    freed = _finishes(enc, so.finished_req_ids, fields)
    ext: dict[str, Any] = {}
    specs = _new_requests(enc, step, ext)
    _cached_requests(enc, step, ext)
    if not mem.mrv2 and not mem.prev_batch.issuperset(step.stay):
        ext["all_keys"] = b""  # the general path predicts all_token_ids for these
    mem.known.update(step.batch)
    mem.prev_batch = set(step.batch)
    reset = {h for _, h in freed}
    added = _adds(enc, step, specs, reset, fields)
    _body_rows(enc, so, step, [h for _, h, _ in added], fields, ext)
    wire = StepExt(**ext)
    fields["extension"] = {"v": msgspec.msgpack.encode(wire)} if wire != StepExt() else {}
    delta = mirror.apply_turnover(DeltaBody(**fields), freed, added, step.batch,
                                  list(map(enc.specs.__getitem__, step.batch)))
    enc.after_general(delta.seq, step.batch, step.computed, step.nsched, tables_built=False)
    enc.turnover_steps += 1
    return codec.encode(delta)


def _finishes(enc: SchedulerOutputEncoder, finished: set[str],
              fields: dict[str, Any]) -> list[tuple[str, int]]:
    """The finished handles and ids into ``fields`` (as the general path writes them);
    the encoder forgets them.  Returns the (id, handle) pairs the mirror frees."""
    freed = finish_fields(enc.mirror.handles, finished, fields)  # type: ignore[union-attr]
    enc.forget(finished)
    return freed


def _new_requests(enc: SchedulerOutputEncoder, step: _Step,
                  ext: dict[str, Any]) -> list[RequestSpec]:
    """The new requests' specs, remembered with their tables (the encoder's
    _new_requests on a batch whose new requests come last, in order)."""
    mem, batch, n = enc.mem, step.batch, len(step.stay)
    # the stayers were in the last batch, so known: only the joiners can be unknown
    unknown = list(compress(range(n, len(batch)), map(not_, map(mem.known.__contains__,
                                                                batch[n:]))))
    flips = sorted(set(range(n, len(batch))).symmetric_difference(unknown))
    if flips:
        ext["new_flip"] = pack_uints(flips)
    specs, fixes = [], []
    for k, nr in enumerate(step.new_reqs):
        spec, fix = new_request_spec(nr, k, enc.spec_reader)
        enc.specs[nr.req_id] = spec
        mem.remember(spec)
        enc.tables[nr.req_id] = [list(b) for b in nr.block_ids]
        specs.append(spec)
        if fix is not None:
            fixes.append(fix)
    if fixes:
        ext["fixes"] = tuple(fixes)
    return specs


def _cached_requests(enc: SchedulerOutputEncoder, step: _Step, ext: dict[str, Any]) -> None:
    """The stayers' appended blocks into the encoder's tables and their empty-block
    flips into ``ext`` (the encoder's _cached_requests, in batch order; the output-count
    departures are :func:`_body_rows`')."""
    tables, stay = enc.tables, step.stay
    pos, counts, flat, empty = step.appends
    at = 0
    for k, c in zip(pos, counts, strict=True):
        table = tables[stay[k]]
        tables[stay[k]] = [table[0] + flat[at:at + c]]
        at += c
    if empty:
        ext["none_flip"] = pack_uints(empty)


def _adds(enc: SchedulerOutputEncoder, step: _Step, specs: list[RequestSpec],
          reset: set[int], fields: dict[str, Any]) -> list[tuple[str, int, RequestSpec]]:
    """Handles for the new requests (in batch order) and their adds into ``fields``."""
    mirror = enc.mirror
    assert mirror is not None  # noqa: S101 - checked by _shape
    adds: list[NewRequest] = []
    added = []
    for nr, spec in zip(step.new_reqs, specs, strict=True):
        h = mirror.allocator.allocate()
        reset.add(h)  # (before its own add: DiffContext._handle_for's order)
        adds.append(new_request(mirror, reset, h, spec, nr.num_computed_tokens))
        added.append((nr.req_id, h, spec))
    if adds:
        fields["added"] = tuple(sorted(adds, key=attrgetter("handle")))
    return added


def _body_rows(enc: SchedulerOutputEncoder, so: Any, step: _Step, joined: list[int],
               fields: dict[str, Any], ext: dict[str, Any]) -> None:
    """The schedule edits, appended blocks, count departures (the output counts' into
    ``ext``) and step fields."""
    mirror = enc.mirror
    assert mirror is not None  # noqa: S101 - checked by _shape
    drop = sorted(set(range(len(enc.quick.batch))).difference(step.stay_at))
    if drop:
        fields["schedule_drop"] = pack_uints(drop)
    if joined:
        fields["schedule_append"] = pack_uints(joined)
    _blocks(step, joined, fields)
    computed, scheduled, outputs = _stayer_rows(enc, step)
    if computed is not None:
        fields["computed_tokens"] = Rows(handles=computed[2], values=computed[3])
    ns, n = step.nsched, len(step.stay)
    joining = [i for i in range(n, len(ns)) if ns[i] != 1]  # new requests predict 1
    if joining:
        at, values = scheduled[:2] if scheduled is not None else ([], [])
        fields["scheduled_tokens"] = Rows(handles=pack_uints(at + joining), values=pack_uints(
            values + list(map(ns.__getitem__, joining))))
    elif scheduled is not None:
        fields["scheduled_tokens"] = Rows(handles=scheduled[2], values=scheduled[3])
    if outputs is not None:
        ext["out_pos"], ext["out_delta"] = outputs[2:]
    if step.drafts is not None:  # (the request's aligned rows, each token plus one)
        fields["spec_tokens"] = Rows(counts=pack_uints(step.drafts[0]),
                                     values=pack_uints_plus_one(step.drafts[1]))
    if so.preempted_req_ids:
        fields["preempted"] = pack_uints(sorted(map(mirror.handles.__getitem__,
                                                    so.preempted_req_ids)))
    fields["has_structured_output"] = so.has_structured_output_requests
    fields["pending_structured_output"] = so.pending_structured_output_tokens
    fields["num_spec_tokens_to_schedule"] = so.num_spec_tokens_to_schedule


def _stayer_rows(enc: SchedulerOutputEncoder, step: _Step,
                 ) -> tuple[CountRows | None, CountRows | None, CountRows | None]:
    """The stayers' (computed, scheduled, output) count departures from the mirror's
    predictions -- its computed plus last scheduled counts, the last scheduled counts,
    and the outputs past the prompt -- found and packed by one C call (``count_rows``;
    its Python reference without the speedups)."""
    mirror, n = enc.mirror, len(step.stay)
    assert mirror is not None  # noqa: S101 - checked by _shape
    cols, hs = mirror.state.cols, np.array(step.handles, dtype=np.int64)
    args = (step.computed[:n], step.outputs, cols.computed[hs].tolist(),
            cols.last_nsched[hs].tolist(), step.nsched[:n],
            # the last batch's prompt lengths less one (a stayer's prompt is unchanged)
            list(map(enc.quick.forecast.plen_less_one.__getitem__, step.stay_at)))
    got = _C.count_rows(*args) if _C is not None else None
    if got is None:
        got = count_rows_py(*args)
    assert got is not None  # noqa: S101 - _shape refused negative counts
    return got[0], got[1], got[2]


def _blocks(step: _Step, joined: list[int], fields: dict[str, Any]) -> None:
    """block_append: the stayers' new blocks, then the new requests' tables (rows in
    batch order; a table is only ever appended to in a turnover step)."""
    pos, counts, flat, _ = step.appends
    hs = list(map(step.handles.__getitem__, pos))
    counts, flat = list(counts), list(flat)
    for h, nr in zip(joined, step.new_reqs, strict=True):
        ids = nr.block_ids[0]
        if ids:
            hs.append(h)
            counts.append(len(ids))
            flat += ids
    if hs:
        fields["block_append"] = (Rows(handles=pack_uints(hs), counts=pack_row_counts(counts),
                                       values=pack_uints(flat)),)
