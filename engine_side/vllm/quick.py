"""The same-batch step: vLLM's common step, encoded without the general path.

Theory of operation
-------------------
Most steps schedule exactly the batch of the step before, in the same order, with
nothing but per-request counts, a few appended blocks and speculative tokens
changing.  :class:`QuickEncoder` recognises such a step from the SchedulerOutput
itself (C-level list comparisons against lists it predicted) and builds the Delta
body the general path (``ExecuteModelRequest`` → ``EngineMirror.diff``) would
build for it -- the same fields, the same bytes -- without building the request.
Anything else returns None and the general path runs.  The worker side
(:mod:`worker_side.vllm.quick`) recognises the body and answers it likewise.

Both ends keep the same forecast (:mod:`engine_side.vllm.forecast`): each scheduled
request's computed count advances by its scheduled count, and ``num_output_tokens`` is
``computed - prompt + 1`` (at least 0), exactly the predictions of the general path.

Contract: :meth:`QuickEncoder.reset` after every general step (with that step's
actual lists); :meth:`QuickEncoder.body` keeps no reference to the SchedulerOutput.
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import add, itemgetter, sub
from typing import Any, Literal

import msgspec
import numpy as np

from engine_side.vllm.convert import draft_rows
from engine_side.vllm.forecast import Forecast, changed
from engine_side.vllm.rare import PLAIN, RARE_NAMES, plain_fields, read_rare
from engine_side.vllm.schema import StepExt
from protocol.lane import Appends
from protocol.lane_lists import NO_ROWS, LaneRows
from protocol.messages import DeltaBody, Rows
from protocol.packing import pack_row_counts, pack_sints, pack_uints, pack_uints_plus_one
from protocol.plan import STEADY_BODY
from protocol.planned import FLAG_BODIES
from protocol.speedups import C as _C

FEW_ROWS = 16  # grown rows up to this many take a Python loop (measured ~1 µs faster to 16)
_NO_ROWS = Rows(handles=pack_uints(np.zeros(0, dtype=np.int64)))
_ENCODE = msgspec.msgpack.encode
_new_tuple = tuple.__new__


class QuickEncoder:
    """Engine side of the same-batch step (see the module docstring)."""

    def __init__(self) -> None:
        self.kv_groups = 1
        self.batch: list[str] = []
        self.pos: dict[str, int] = {}
        self.handles: list[int] = []
        self.index: list[int] = []  # 0..n-1, made once per batch (compress() without range())
        #: the last quick step's appends per KV group for the steady lane (positions,
        #: counts, ids; [] for none)
        self.appends: list[tuple[list[int], list[int], list[int]]] = []
        #: the last quick step's count and draft rows, the lists its body was packed from
        self.rows = NO_ROWS
        self.forecast = Forecast([])
        self.ready = False

    def reset(self, batch: list[str], handles: list[int], computed: list[int],
              nsched: list[int], plen: list[int], kv_groups: int) -> None:
        """After a general step: that step's batch, handles and actual counts."""
        self.batch, self.handles, self.kv_groups = batch, handles, kv_groups
        self.pos = dict(zip(batch, range(len(batch)), strict=True))
        self.index = list(range(len(batch)))
        self.forecast = Forecast(plen)
        self.forecast.restart(computed, nsched)
        self.ready = True

    def body(self, so: Any, scanned: bool = False) -> DeltaBody | None:
        """The Delta body of ``so`` if it is a same-batch step, else None (nothing changed).
        Callers try :meth:`plain_step` first, which answers a plain step without building
        field dicts, then :meth:`scan` (``scanned``: it did not take ``so``); this reads
        any same-batch step."""
        if not self.ready:
            return None
        if not scanned:
            scan = self.scan(so)
            if scan is not None:
                return self.scanned_body(scan)
        if not plain_fields(so):
            return None
        cached, batch = so.scheduled_cached_reqs, self.batch
        if cached.req_ids != batch or len(cached.new_block_ids) != len(batch):
            return None
        nsched, same_ns = self._nsched(so.num_scheduled_tokens)
        if nsched is None:
            return None
        if so.total_num_scheduled_tokens != (self.forecast.total if same_ns else sum(nsched)):
            return None
        blocks = self._blocks(cached.new_block_ids)
        spec = self._spec(so.scheduled_spec_decode_tokens)
        if blocks is None or spec is None:
            return None
        fields: dict[str, Any] = {}
        lists: dict[str, tuple[list[int], list[int]]] = {}
        counts = self._counts(cached, nsched, same_ns, fields, lists)
        if counts is None:
            return None
        if blocks:
            fields["block_append"] = blocks
        if spec is not True:
            fields["spec_tokens"], lists["drafts"] = spec
        self.rows = LaneRows(**lists) if lists else NO_ROWS
        if so.has_structured_output_requests:
            fields["has_structured_output"] = True
        if so.pending_structured_output_tokens:
            fields["pending_structured_output"] = True
        if so.num_spec_tokens_to_schedule:
            fields["num_spec_tokens_to_schedule"] = so.num_spec_tokens_to_schedule
        if counts[0]:
            fields["extension"] = {"v": _ENCODE(StepExt(out_pos=counts[0], out_delta=counts[1]))}
        return DeltaBody(**fields) if fields else STEADY_BODY

    def scan(self, so: Any) -> Scan | None:
        """What :meth:`body` reads of a same-batch step, by one C call (``same_batch_scan``:
        the reads, checks and packed rows of :meth:`_nsched`, :meth:`_blocks`,
        :meth:`_spec` and :meth:`_counts`); None, nothing changed, without the speedups or
        when C does not take the step (:meth:`body`'s lines decide, refusals included).
        A scan is taken by :meth:`scanned` (then :meth:`scanned_body` or the caller's
        own frame of it)."""
        if not self.ready or _C is None:
            return None
        fc = self.forecast
        return _C.same_batch_scan(  # type: ignore[no-any-return]
            so, self.batch, self.pos, fc.comp_rows[fc.next - 1] if fc.next else fc._base,
            fc.nsched, fc.total, fc.plen_less_one, self.handles, RARE_NAMES, PLAIN,
            self.kv_groups == 1)  # (the basis: Forecast.basis inline)

    def scanned(self, scan: Scan) -> None:
        """The step of ``scan`` is taken: the forecast rebases on its actual counts and
        :attr:`appends` and :attr:`rows` are its own."""
        nsched, same_ns, appends, _, _, counts, _, _, _, total = scan
        self.appends = [] if appends is None else [appends]
        self.rows = scan_rows(scan)
        self.forecast.rebase(counts[3], nsched, same_ns, total)

    def scanned_body(self, scan: Scan) -> DeltaBody:
        """The Delta body of ``scan``, taken (:meth:`scanned`)."""
        self.scanned(scan)
        fields = scan_fields(scan)
        return DeltaBody(**fields) if fields else STEADY_BODY

    def plain_step(self, so: Any) -> tuple[DeltaBody, Packed | None] | None:
        """(the step's structured-output flags as their body -- :data:`FLAG_BODIES` --, the
        packed Rows fields of its block appends or None for none) when ``so`` is exactly
        the forecast step but for one KV group's block appends and those flags, found by
        one C call (:func:`plain_check_py` without the speedups; the forecast then
        advances, :attr:`appends` and :attr:`rows` are set as :meth:`body` sets them);
        None, nothing changed, for any other step (:meth:`body` decides).  The step's
        body is the flags' with ``block_append=(Rows(*packed),)``."""
        if not self.ready:
            return None
        fc = self.forecast
        got = (_C.plain_check if _C is not None else plain_check_py)(
            so, self.batch, fc.nsched, fc.total, fc.comp_rows[fc.next - 1] if fc.next
            else fc._base, fc.plen_less_one, RARE_NAMES, PLAIN, self.kv_groups == 1,
            self.handles)  # (the basis: Forecast.basis inline)
        if got is None:
            return None
        appends, packed, structured, pending, actual = got
        if appends is not None and packed is None:
            grown, lens, flat = appends
            packed = packed_appends(grown, lens, flat, self.handles)
            if packed is None:
                return None  # ids that do not pack: the general path refuses them
        fc._base, fc.comp_rows, fc.out_rows, fc.next = actual, [], [], 0  # rebase, same nsched
        fc._last, fc._decoding = None, False
        self.rows = NO_ROWS
        self.appends = [] if appends is None else [appends]
        return FLAG_BODIES[structured, pending], packed

    def _nsched(self, counts: Any) -> tuple[list[int] | None, bool]:
        """(this step's scheduled counts, whether they are the forecast's); None when the
        requests are not the batch in its order."""
        known = self.forecast.nsched
        match = _C.dict_matches(counts, self.batch, known) if _C is not None else None
        if match == 2:  # builds no list
            return known, True
        if match == 0 or (match is None and list(counts) != self.batch):
            return None, False
        nsched = list(counts.values())
        return nsched, nsched == known

    def _counts(self, cached: Any, nsched: list[int], same_ns: bool, fields: dict[str, Any],
                lists: dict[str, tuple[list[int], list[int]]]) -> tuple[bytes, bytes] | None:
        """Scheduled / computed exceptions into ``fields`` (and as lists into ``lists``);
        output departures returned (positions and deltas, empty when there are none)."""
        fc = self.forecast
        actual, outs = cached.num_computed_tokens, cached.num_output_tokens
        if _C is not None:
            done = self._counts_c(actual, outs, nsched, same_ns, fields, lists)
            if done is not False:
                return done  # type: ignore[return-value]
        comp, comp_outs = fc.take()
        if len(actual) != len(comp) or len(outs) != len(comp):
            return None  # the general path refuses it
        if actual == comp:
            predicted = comp_outs
        else:
            moved = changed(actual, comp)
            now = list(map(actual.__getitem__, moved))
            if min(now) < 0:
                return None  # the general path refuses it
            moves = list(map(sub, now, map(comp.__getitem__, moved)))
            fields["computed_tokens"] = Rows(handles=pack_uints(moved), values=pack_sints(moves))
            lists["computed"] = (moved, moves)
            predicted = fc.outputs(actual)
        if not same_ns:
            self._scheduled(nsched, fields, lists)
        ext = (b"", b"")
        if outs != predicted:
            off = changed(outs, predicted)
            ext = (pack_uints(off), pack_sints(list(map(
                sub, map(outs.__getitem__, off), map(predicted.__getitem__, off)))))
        if same_ns and "computed_tokens" not in fields:
            fc.advanced()
        else:
            fc.restart(list(actual), nsched)
        return ext

    def _counts_c(self, actual: Any, outs: Any, nsched: list[int], same_ns: bool,
                  fields: dict[str, Any], lists: dict[str, tuple[list[int], list[int]]],
                  ) -> tuple[bytes, bytes] | None | bool:
        """:meth:`_counts` in one C call (``count_rows``): the departures are found and
        packed without building the predicted rows (the forecast then restarts from
        ``actual``).  False: C did not take the lists, the Python path decides."""
        fc = self.forecast
        got = None if _C is None else _C.count_rows(actual, outs, fc.basis(), fc.nsched,
                                                     nsched, fc.plen_less_one)
        if got is None:
            return False
        computed, scheduled, outputs, copy = got
        _count_fields(computed, scheduled, fields, lists)
        fc.rebase(copy, nsched, same_ns)
        return (b"", b"") if outputs is None else outputs[2:]

    def _scheduled(self, nsched: list[int], fields: dict[str, Any],
                   lists: dict[str, tuple[list[int], list[int]]]) -> None:
        """The scheduled counts that changed, into ``fields`` and ``lists``."""
        moved = changed(nsched, self.forecast.nsched)
        values = list(map(nsched.__getitem__, moved))
        fields["scheduled_tokens"] = Rows(handles=pack_uints(moved), values=pack_uints(values))
        lists["scheduled"] = (moved, values)

    def _blocks(self, new_blocks: list[Any]) -> tuple[Rows, ...] | None:
        """block_append per KV group (() for none); None when the step needs the general path.
        Keeps the appends as our own lists (:attr:`appends`)."""
        if self.kv_groups == 1 and _C is not None and len(new_blocks) == len(self.index):
            got = _C.one_group_appends(new_blocks)  # None: Python decides below
            if got is not None:
                return self._one_group_rows(*got)
        grown = list(compress(self.index, new_blocks))
        self.appends = []
        if not grown:
            return () if new_blocks.count(None) == len(new_blocks) else None
        if len(grown) + new_blocks.count(None) != len(new_blocks):
            return None  # a falsy entry that is not None
        groups = self.kv_groups
        if groups == 1:  # the common case
            lists = _one_block_group(grown, new_blocks)
            if lists is None:
                return None
            return self._one_group_rows(grown, *lists)
        entries = list(map(new_blocks.__getitem__, grown))
        rows: list[list[int]] = [[] for _ in range(groups)]
        at: list[list[int]] = [[] for _ in range(groups)]
        counts: list[list[int]] = [[] for _ in range(groups)]
        values: list[list[int]] = [[] for _ in range(groups)]
        for k, entry in zip(grown, entries, strict=True):
            if len(entry) != groups or not any(entry):
                return None
            for g, ids in enumerate(entry):
                if ids:
                    rows[g].append(self.handles[k])
                    at[g].append(k)
                    counts[g].append(len(ids))
                    values[g] += ids
        self.appends = list(zip(at, counts, values, strict=True))
        return tuple(Rows(handles=pack_uints(rows[g]), counts=pack_row_counts(counts[g]),
                          values=pack_uints(values[g])) if rows[g] else _NO_ROWS
                     for g in range(groups))

    def _one_group_rows(self, grown: list[int], lens: list[int], flat: list[int],
                        ) -> tuple[Rows, ...] | None:
        """The block_append of one KV group's appends (() for none), kept as
        :attr:`appends`; None when the ids do not pack (the general path refuses them)."""
        if not grown:
            self.appends = []
            return ()
        self.appends = [(grown, lens, flat)]
        packed = _C.pack_appends(grown, lens, flat, self.handles) if _C is not None else None
        if packed is None:
            packed = packed_appends(grown, lens, flat, self.handles)
        return None if packed is None else (Rows(*packed),)

    def _spec(self, drafts: dict[str, list[int]],
              ) -> tuple[Rows, tuple[list[int], list[int]]] | Literal[True] | None:
        """Speculative tokens as aligned rows and as (tokens per position, flat tokens)
        (True: none); None unless non-empty lists in batch order."""
        if not drafts:
            return True
        got = draft_rows(drafts, self.pos, len(self.batch))
        if got is None:
            return None  # an unknown request, an empty list, or out of batch order
        lengths, flat = got
        return Rows(counts=pack_uints(lengths), values=pack_uints_plus_one(flat)), got



def scan_rows(scan: Scan) -> LaneRows:
    """The count and draft rows of a same-batch step's ``scan`` as the lane takes them
    (:data:`NO_ROWS` itself for none)."""
    drafts, (computed, scheduled, _, _) = scan[4], scan[5]
    if computed is None and scheduled is None and drafts is None:
        return NO_ROWS
    return _new_tuple(LaneRows, (computed and computed[:2], scheduled and scheduled[:2],
                                 drafts and drafts[:2]))  # (LaneRows' own __new__ is Python)


def scan_fields(scan: Scan) -> dict[str, Any]:
    """The DeltaBody fields of a same-batch step's ``scan`` (none for the steady body)."""
    _, _, _, packed, drafts, counts, structured, pending, nspec, _ = scan
    computed, scheduled, outputs, _ = counts
    fields: dict[str, Any] = {}
    if computed is not None:
        fields["computed_tokens"] = Rows(handles=computed[2], values=computed[3])
    if scheduled is not None:
        fields["scheduled_tokens"] = Rows(handles=scheduled[2], values=scheduled[3])
    if packed is not None:
        fields["block_append"] = (Rows(*packed),)
    if drafts is not None:
        fields["spec_tokens"] = Rows(counts=drafts[2], values=drafts[3])
    if structured:
        fields["has_structured_output"] = True
    if pending:
        fields["pending_structured_output"] = True
    if nspec:
        fields["num_spec_tokens_to_schedule"] = nspec
    if outputs is not None:
        fields["extension"] = {"v": _ENCODE(StepExt(out_pos=outputs[2], out_delta=outputs[3]))}
    return fields


def _count_fields(computed: CountRows | None, scheduled: CountRows | None,
                  fields: dict[str, Any], lists: dict[str, tuple[list[int], list[int]]],
                  ) -> None:
    """The computed and scheduled count rows (``count_rows``' first two) into the body's
    ``fields`` as Rows and into ``lists`` for the lane."""
    if computed is not None:
        fields["computed_tokens"] = Rows(handles=computed[2], values=computed[3])
        lists["computed"] = computed[:2]
    if scheduled is not None:
        fields["scheduled_tokens"] = Rows(handles=scheduled[2], values=scheduled[3])
        lists["scheduled"] = scheduled[:2]


def _one_block_group(grown: list[int], new_blocks: list[Any],
                     ) -> tuple[list[int], list[int]] | None:
    """(ids per grown row, flat ids) of a one-group step's ``new_blocks`` at ``grown``;
    None unless every grown entry is one non-empty group.  A loop for a few rows,
    C-level maps past :data:`FEW_ROWS` (no per-row bytecode)."""
    if len(grown) <= FEW_ROWS:
        lens: list[int] = []
        flat: list[int] = []
        for k in grown:
            entry = new_blocks[k]
            if len(entry) != 1 or not entry[0]:
                return None
            lens.append(len(entry[0]))
            flat += entry[0]
        return lens, flat
    entries = list(map(new_blocks.__getitem__, grown))
    if set(map(len, entries)) != {1}:
        return None
    ids = list(map(itemgetter(0), entries))
    if not all(ids):
        return None
    return list(map(len, ids)), list(chain.from_iterable(ids))


def plain_check_py(so: Any, batch: list[str], nsched: list[int], total: int,
                   basis: list[int], plen_less_one: list[int], rare: Any, plain: tuple[Any, ...],
                   one_group: bool, handles: list[int],
                   ) -> tuple[Appends | None, Packed | None, bool, bool, list[int]] | None:
    """(appends, packed, structured, pending, a copy of the computed counts) when ``so``
    is the forecast step -- ``batch`` in order with ``nsched`` tokens each (``total`` in
    all), computed counts ``basis + nsched``, output counts as :meth:`Forecast.outputs`
    predicts -- but for one KV group's block appends (positions, counts, flat ids; None
    for none; any appends need ``one_group``) and the structured-output flags, and
    its rare fields (:func:`read_rare`) are ``plain``; None for any other step.
    ``packed``: the appends' Rows fields, the rows named by their ``handles``
    (:func:`packed_appends`; None for no appends).  The reference of the C
    ``plain_check``, which may refuse more (None) but never answers otherwise."""
    cached = so.scheduled_cached_reqs
    new_blocks = cached.new_block_ids
    if (type(new_blocks) is not list or len(new_blocks) != len(batch)
            or so.scheduled_spec_decode_tokens or cached.req_ids != batch
            or so.total_num_scheduled_tokens != total or read_rare(so, rare) != plain
            or so.num_spec_tokens_to_schedule or type(so.num_scheduled_tokens) is not dict
            or list(so.num_scheduled_tokens) != batch
            or list(so.num_scheduled_tokens.values()) != nsched):
        return None
    appends = None
    if new_blocks.count(None) != len(new_blocks):
        grown = [i for i, entry in enumerate(new_blocks) if entry is not None]
        if not one_group or any(type(new_blocks[i]) not in (tuple, list) for i in grown):
            return None
        lists = _one_block_group(grown, new_blocks)
        if lists is None:
            return None
        appends = (grown, *lists)
    actual, outs = cached.num_computed_tokens, cached.num_output_tokens
    if (type(actual) is not list or len(actual) != len(batch)
            or actual != list(map(add, basis, nsched))
            or outs != [max(c - p, 0) for c, p in zip(actual, plen_less_one, strict=True)]):
        return None
    return (appends, None if appends is None else packed_appends(*appends, handles),
            bool(so.has_structured_output_requests), bool(so.pending_structured_output_tokens),
            list(actual))


#: one set of count rows: (positions, values, packed positions, packed values)
CountRows = tuple[list[int], list[int], bytes, bytes]


def count_rows_py(computed: list[int], outputs: list[int], basis: list[int],
                  nsched_before: list[int], nsched: list[int], plen_less_one: list[int],
                  ) -> tuple[CountRows | None, CountRows | None, CountRows | None,
                             list[int]] | None:
    """(computed rows, scheduled rows, output rows, a copy of ``computed``) of a same-batch
    step against the forecast: the signed moves where ``computed`` departs from ``basis
    + nsched_before``, the counts where ``nsched`` departs from ``nsched_before``, the
    signed moves where ``outputs`` departs from ``max(computed - plen_less_one, 0)``
    (None for no rows; signed values packed zig-zag).  None when a moved computed count
    or a scheduled count is negative.  The reference of the C ``count_rows``, which
    also refuses (None) values past int64."""
    moved = changed(computed, list(map(add, basis, nsched_before)))
    if min(map(computed.__getitem__, moved), default=0) < 0 or min(nsched, default=0) < 0:
        return None
    moves = [computed[i] - basis[i] - nsched_before[i] for i in moved]
    sched = changed(nsched, nsched_before)
    values = list(map(nsched.__getitem__, sched))
    want = list(map(max, map(sub, computed, plen_less_one), repeat(0)))
    off = changed(outputs, want)
    deltas = [outputs[i] - want[i] for i in off]
    return (_rows(moved, moves, pack_sints), _rows(sched, values, pack_uints),
            _rows(off, deltas, pack_sints), list(computed))


def _rows(at: list[int], values: list[int], pack: Any) -> CountRows | None:
    return (at, values, pack_uints(at), pack(values)) if at else None


#: one group's appends as Rows fields: (packed handles, packed counts, packed ids)
Packed = tuple[bytes, bytes, bytes]

#: ``same_batch_scan``'s answer: (scheduled counts, whether they are the forecast's, one
#: group's appends, their packed Rows fields, the drafts as (tokens per position, flat
#: tokens, packed counts, packed values plus one), (computed rows, scheduled rows, output
#: rows, a copy of the computed counts), the structured-output flags,
#: num_spec_tokens_to_schedule, the total of the scheduled counts); None for no appends,
#: drafts or rows
Scan = tuple[list[int], bool, Appends | None, Packed | None, CountRows | None,
             tuple[CountRows | None, CountRows | None, CountRows | None, list[int]],
             bool, bool, int, int]


def packed_appends(grown: list[int], lens: list[int], flat: list[int], handles: list[int],
                   ) -> Packed | None:
    """The Rows fields of one group's appends (rows ``grown`` named by ``handles``; b""
    for counts that are all one); None when the lists do not pack.  The reference of
    the C ``pack_appends``."""
    try:
        return (pack_uints(list(map(handles.__getitem__, grown))), pack_row_counts(lens),
                pack_uints(flat))
    except (ValueError, OverflowError, TypeError, IndexError):
        return None
