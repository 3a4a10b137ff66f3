"""Worker side of the same-batch step (see :mod:`engine_side.vllm.quick`).

A Delta body that keeps the schedule and carries nothing but count exceptions,
block appends, speculative tokens and step flags -- with no vLLM departure but
``num_output_tokens`` -- is answered from the decoder's lists of the last step,
after the steady lane (:mod:`protocol.lane`; the replica state when the lane
refuses it) applied and so validated it: no rebuild, no numpy column per field.
The SchedulerOutput is equal to the general path's and made of fresh objects.
"""

from __future__ import annotations

from functools import cache
from itertools import repeat
from operator import add, attrgetter
from typing import Any

import msgspec

from engine_side.vllm.convert import split_rows
from engine_side.vllm.forecast import Forecast
from engine_side.vllm.schema import StepExt
from protocol import codec
from protocol.errors import DECODE_ERRORS, InvalidDelta, malformed
from protocol.lane import Appends, SteadyLane
from protocol.lane_lists import LaneRows, add_at, lane_rows, lane_shaped
from protocol.messages import Delta, DeltaBody, Rows
from protocol.packing import unpack_sint_list, unpack_uint_list
from protocol.plan import STEADY_BODY
from protocol.speedups import C as _C


def _ints(packed: bytes) -> list[int]:
    return unpack_uint_list(packed) if packed else []


EXT_DECODER = msgspec.msgpack.Decoder(StepExt)  # a step's extension["v"]
NO_EXT = StepExt()  # the extension of a step that carries none (shared: frozen)
#: the StepExt fields besides the output departures, read by one C call (see plain_body)
_EXT_OTHERS = attrgetter(*(f for f in StepExt.__struct_fields__
                           if f not in ("out_pos", "out_delta")))
_NO_EXT_OTHERS = _EXT_OTHERS(NO_EXT)


def decode_ext(raw: bytes | None) -> StepExt:
    """A step's ``extension["v"]`` (NO_EXT when absent); MalformedMessage for bad bytes."""
    if not raw:
        return NO_EXT
    try:
        return EXT_DECODER.decode(raw)
    except DECODE_ERRORS as exc:
        raise malformed("bad vLLM step extension", exc) from exc


def frame_objects(frame: bytes) -> tuple[DeltaBody, StepExt]:
    """The body and extension of a Delta frame ``lane_view`` read."""
    msg = codec.decode([frame])
    assert isinstance(msg, Delta)  # noqa: S101 - lane_view reads Deltas alone
    return msg.body, decode_ext(msg.body.extension.get("v"))


def plain_body(body: DeltaBody, ext: StepExt) -> bool:
    """Whether ``body`` keeps the batch (:func:`protocol.lane_lists.lane_shaped`) and ``ext``
    departs only in output counts."""
    if ext is not NO_EXT and _EXT_OTHERS(ext) != _NO_EXT_OTHERS:
        return False
    return lane_shaped(body)


#: the DeltaBody fields of a plain step, and the others, read by one C call (see plain)
_PLAIN_FIELDS = ("block_append", "has_structured_output", "pending_structured_output")
_OTHERS = attrgetter(*(f for f in DeltaBody.__struct_fields__ if f not in _PLAIN_FIELDS))
_NO_FIELDS = _OTHERS(STEADY_BODY)


def plain(body: DeltaBody) -> bool:
    """Whether ``body`` carries nothing but block appends and the structured-output
    flags (no extension either): the forecast step with those."""
    return _OTHERS(body) == _NO_FIELDS


@cache
def vllm_types() -> tuple[Any, Any, Any]:
    """vLLM's CachedRequestData, SchedulerOutput and GrammarOutput, imported once (an
    import statement costs ~1 µs a step)."""
    from vllm.v1.core.sched.output import CachedRequestData, GrammarOutput, SchedulerOutput

    return CachedRequestData, SchedulerOutput, GrammarOutput


def made(cls: Any, fields: dict[str, Any]) -> Any:
    """An instance of dataclass ``cls`` holding ``fields`` (every field, in declaration
    order; the dict becomes the instance's own, so pass a fresh one), built the way
    ``pickle.loads`` builds it: ``__new__`` and the instance dict, without the
    generated ``__init__`` (a microsecond per call at a dozen keyword arguments).  Only
    for vLLM's plain step dataclasses (no ``__post_init__``, no slots; checked by
    ``tests/test_vllm_quick.py``)."""
    obj = cls.__new__(cls)
    obj.__dict__ = fields
    return obj


class QuickDecoder:
    """The decoder's lists of the last step and the same-batch SchedulerOutput."""

    def __init__(self, types: tuple[Any, Any, Any] | None = None) -> None:
        self.batch: list[str] = []
        self.at: dict[int, int] = {}  # handle -> batch position
        self.nsched: list[int] = []
        self.nsched_map: dict[str, int] = {}
        self.forecast = Forecast([])
        self.kv_groups = 1
        self.ready = False
        self.types = vllm_types() if types is None else types  # (vllm_types())

    def reset(self, batch: list[str], handles: list[int], computed: list[int],
              nsched: dict[str, int], plen: list[int], kv_groups: int) -> None:
        """After a general step: its batch, handles and counts (``nsched`` is copied)."""
        self.batch, self.kv_groups = batch, kv_groups
        self.at = dict(zip(handles, range(len(handles)), strict=True))
        self.nsched_map = dict(nsched)
        self.nsched = list(nsched.values())
        self.forecast = Forecast(plen)
        self.forecast.restart(computed, self.nsched)
        self.forecast.take()  # its first row now: the general step pays, not the next
        self.ready = True

    def lane_inputs(self, body: DeltaBody, ext: StepExt,
                    ) -> tuple[list[Appends], LaneRows, list[Any] | None] | None:
        """(block appends, count and draft rows, the step's new_block_ids when already
        made) of a same-batch body, unpacked once for the steady lane and
        :meth:`scheduler_output`; None when the general path decides (a field that does
        not unpack included: the state raises it, typed)."""
        if not plain_body(body, ext):
            return None
        got = self.plain_blocks(body.block_append) if body.block_append else ([], None)
        rows = None if got is None else lane_rows(body, len(self.batch))
        return None if got is None or rows is None else (got[0], rows, got[1])

    def counted_step(self, lane: SteadyLane, body: DeltaBody, ext: StepExt,
                     digest: int) -> Any:
        """The SchedulerOutput of a same-batch body, its step applied to ``lane``, in one C
        call (``counted_step``: the lines of :meth:`lane_inputs`,
        :meth:`SteadyLane.counted <protocol.lane.SteadyLane.counted>` and
        :meth:`scheduler_output`); None, nothing changed, without the speedups or when
        C does not take it (those lines decide).  Raises InvalidDelta, nothing
        changed, when the step's digest is not ``digest``."""
        if not plain_body(body, ext):
            return None
        return self._counted(lane, (
            body.computed_tokens, body.scheduled_tokens, body.spec_tokens, body.block_append,
            ext.out_pos, ext.out_delta, body.has_structured_output,
            body.pending_structured_output, body.num_spec_tokens_to_schedule), digest, body,
            (body, ext))

    def counted_view(self, lane: SteadyLane, view: tuple[Any, ...], frame: bytes) -> Any:
        """:meth:`counted_step` of the frame of a Delta read by ``lane_view`` (``view``;
        its seq is the caller's to check), no body or extension made: the lane keeps the
        frame as its last step's body."""
        return self._counted(lane, view[3:], view[2], frame, None)

    def _counted(self, lane: SteadyLane, fields: tuple[Any, ...], digest: int,
                 last: DeltaBody | bytes, objects: tuple[DeltaBody, StepExt] | None,
                 ) -> Any:
        """:meth:`counted_step` of a body's fields in ``counted_step``'s order
        (``computed`` .. ``nspec``; Rows or lane_view's tuples), ``last`` the lane's
        record of it and ``objects`` its (body, extension), for the Python lines if C
        leaves the output to them (None: ``last`` is the Delta's frame, read then)."""
        if _C is None or self.kv_groups != 1:
            return None
        inputs = lane.count_inputs(fields[0] is not None, fields[1] is not None,
                                   bool(fields[3]))
        if inputs is None:
            return None
        fc = self.forecast
        cached_cls, so_cls, _ = self.types
        got = _C.counted_step(cached_cls, so_cls, fields, self.at, self.batch, self.nsched_map,
                              fc.basis(), fc.nsched, fc.plen_less_one, inputs, digest)
        if type(got) is int:  # the digest, which differs: nothing done
            raise InvalidDelta("state digest mismatch", expected=digest, got=got)
        if got is None:
            return None
        done, out, rows, added, new_blocks = got
        lane.counts_taken(done, added, last)
        if out is None:  # the lane took the step, C did not make its output
            body, ext = objects if objects is not None else frame_objects(last)  # type: ignore[arg-type]
            return self.scheduler_output(body, ext, [] if added is None else [added],
                                         LaneRows(*rows), new_blocks)
        so, computed_now, nsched, total = out
        if nsched is not None:
            self.nsched = nsched
        fc.restart(computed_now, self.nsched, total)
        return so

    def blocks(self, appends: tuple[Rows, ...]) -> list[Appends] | None:
        """Per group (positions, counts, flat ids) of a body's block_append ``appends``; None
        if one is unscheduled."""
        out = []
        for rows in appends:
            hs = _ints(rows.handles)
            counts = _ints(rows.counts) if rows.counts else [1] * len(hs)  # absent: one each
            pos = list(map(self.at.get, hs, repeat(-1, len(hs))))
            if -1 in pos or 0 in counts:
                return None
            out.append((pos, counts, _ints(rows.values)))
        return out

    def plain_blocks(self, appends: tuple[Rows, ...],
                     ) -> tuple[list[Appends], list[Any] | None] | None:
        """(:meth:`blocks`, the step's ``new_block_ids`` when already made -- one C call for
        one group's appends -- else None) of a :func:`plain` body's block_append; None as
        :meth:`blocks`."""
        if _C is not None and self.kv_groups == 1 and len(appends) == 1:
            rows = appends[0]
            got = _C.append_rows(rows.handles, rows.counts, rows.values, self.at, len(self.batch))
            if got is not None:
                return [got[:3]], got[3]
        blocks = self.blocks(appends)
        return None if blocks is None else (blocks, None)

    def scheduler_output(self, body: DeltaBody, ext: StepExt, blocks: list[Appends],
                         rows: LaneRows, new_blocks: list[Any] | None = None) -> Any:
        """The step's SchedulerOutput (state already applied; ``blocks`` from :meth:`blocks`,
        ``rows`` the body's :func:`protocol.lane_lists.lane_rows`, ``new_blocks`` the step's
        new_block_ids when :meth:`plain_blocks` made them)."""
        if new_blocks is None and blocks:  # (one C call made them for one KV group)
            new_blocks = self._new_blocks(blocks)
        so = self._counted_output(body, ext, rows, new_blocks)
        if so is not None:
            return so
        nsched = self._nsched(rows.scheduled)
        total = self.forecast.total if nsched is self.nsched else sum(nsched)
        computed, outputs = self._counts(rows.computed, nsched, ext)
        if new_blocks is None:
            new_blocks = [None] * len(self.batch)
        return self._assemble(computed, outputs, new_blocks, total, self._drafts(rows.drafts),
                              body)

    def _counted_output(self, body: DeltaBody, ext: StepExt, rows: LaneRows,
                        new_blocks: list[Any] | None) -> Any:
        """:meth:`scheduler_output` of a step with count rows (``new_blocks`` its
        new_block_ids, None for no appends) in one C call
        (``count_output``: :func:`count_lists_py`'s counts, the drafts split and the
        objects assembled; the forecast restarts from the counts); None, nothing changed
        but the id -> count map set to the same counts, without count rows or when C
        does not take the step (the lines of :meth:`scheduler_output` decide)."""
        if _C is None or (rows.computed is None and rows.scheduled is None):
            return None
        fc = self.forecast
        cached_cls, so_cls, _ = self.types
        got = _C.count_output(cached_cls, so_cls, fc.basis(), fc.nsched, fc.plen_less_one,
                              rows.computed, rows.scheduled, ext.out_pos, ext.out_delta,
                              self.batch, self.nsched_map, new_blocks, rows.drafts,
                              body.has_structured_output, body.pending_structured_output,
                              body.num_spec_tokens_to_schedule)
        if got is None:
            return None
        so, computed, nsched, _ = got
        if nsched is not None:
            self.nsched = nsched
        fc.restart(computed, self.nsched)
        return so

    def steady_output(self, blocks: list[tuple[list[int], list[int], list[int]]] | None = None,
                      body: DeltaBody = STEADY_BODY, new_blocks: list[Any] | None = None) -> Any:
        """:meth:`scheduler_output` of the empty body (the steady decode step), or of a
        :func:`plain` ``body`` whose appends are ``blocks`` (:meth:`blocks`; None: none) and
        ``new_blocks`` the step's new_block_ids when :meth:`plain_blocks` made them."""
        fc = self.forecast
        if fc.next >= len(fc.comp_rows):  # Forecast.take and advanced, inline
            fc.take()
        computed, outputs = fc.comp_rows[fc.next], fc.out_rows[fc.next]
        fc.next += 1
        if new_blocks is None:
            new_blocks = [None] * len(self.batch) if blocks is None else self._new_blocks(blocks)
        # the forecast predicts from its computed rows (copied: vLLM owns what it gets);
        # an output row is read once, by this take
        return self._assemble(list(computed), outputs, new_blocks, fc.total, {}, body)

    def _assemble(self, computed: list[int], outputs: list[int], new_blocks: list[Any],
                  total: int, drafts: dict[str, list[int]], body: DeltaBody) -> Any:
        """The step's objects, all fresh, from this step's lists (one C call with the
        speedups, the lines below without)."""
        CachedRequestData, SchedulerOutput, _ = self.types  # noqa: N806 - classes
        if _C is not None:
            so = _C.step_output(CachedRequestData, SchedulerOutput, self.batch, self.nsched_map,
                                new_blocks, computed, outputs, total, drafts,
                                body.has_structured_output, body.pending_structured_output,
                                body.num_spec_tokens_to_schedule)
            if so is not None:
                return so
        cached = made(CachedRequestData, {
            "req_ids": list(self.batch), "resumed_req_ids": set(), "new_token_ids": [],
            "all_token_ids": {}, "new_block_ids": new_blocks, "num_computed_tokens": computed,
            "num_output_tokens": outputs})
        return made(SchedulerOutput, {
            "scheduled_new_reqs": [], "scheduled_cached_reqs": cached,
            "num_scheduled_tokens": dict(self.nsched_map),
            "total_num_scheduled_tokens": total,
            "scheduled_spec_decode_tokens": drafts,
            "scheduled_encoder_inputs": {}, "finished_req_ids": set(),
            "free_encoder_mm_hashes": [], "scheduled_encoder_input_stats": None,
            "preempted_req_ids": set(),
            "has_structured_output_requests": body.has_structured_output,
            "pending_structured_output_tokens": body.pending_structured_output,
            "num_invalid_spec_tokens": None, "kv_connector_metadata": None,
            "has_sync_kv_loads": False, "aux_output_connector_metadata": None,
            "ec_connector_metadata": None, "ec_manager_metadata": None,
            "new_block_ids_to_zero": None, "kv_cache_block_copies": None,
            "kv_connector_block_state": None,
            "num_spec_tokens_to_schedule": body.num_spec_tokens_to_schedule,
            "num_common_prefix_blocks": []})

    def _nsched(self, rows: tuple[list[int], list[int]] | None) -> list[int]:
        if rows is None:
            return self.nsched
        nsched, names = list(self.nsched), self.nsched_map
        for i, v in zip(*rows, strict=True):
            nsched[i] = names[self.batch[i]] = v
        return nsched

    def _counts(self, rows: tuple[list[int], list[int]] | None, nsched: list[int],
                ext: StepExt) -> tuple[list[int], list[int]]:
        """Fresh (computed, outputs) lists; advances the forecast."""
        fc = self.forecast
        if rows is None:
            comp, outs = fc.take()
            computed, outputs = list(comp), list(outs)
        else:  # departures: the advance from the basis, corrected (no forecast row made)
            computed = list(map(add, fc.basis(), fc.nsched))
            add_at(computed, *rows)
            outputs = fc.outputs(computed)
        if rows is None and nsched is self.nsched:
            fc.advanced()
        else:
            self.nsched = nsched
            fc.restart(list(computed), nsched)
        if ext.out_pos:
            add_at(outputs, _ints(ext.out_pos), unpack_sint_list(ext.out_delta))
        return computed, outputs

    def _new_blocks(self, blocks: list[tuple[list[int], list[int], list[int]]],
                    ) -> list[tuple[list[int], ...] | None]:
        out: list[Any] = [None] * len(self.batch)
        groups = self.kv_groups
        if groups == 1 and blocks:  # (the lane refused a row named twice)
            pos, counts, values = blocks[0]
            if len(values) == len(pos):  # one block per row (counts are >= 1)
                for i, v in zip(pos, values, strict=True):
                    out[i] = ([v],)
                return out
            start = 0
            for i, c in zip(pos, counts, strict=True):
                out[i] = (values[start:start + c],)
                start += c
            return out
        for g, (pos, counts, values) in enumerate(blocks):
            start = 0
            for i, c in zip(pos, counts, strict=True):
                entry = out[i]
                if entry is None:
                    entry = out[i] = tuple([] for _ in range(groups))
                entry[g].extend(values[start:start + c])
                start += c
        return out

    def _drafts(self, rows: tuple[list[int], list[int]] | None) -> dict[str, list[int]]:
        if rows is None:
            return {}
        return split_rows(self.batch, *rows)


def count_lists_py(basis: list[int], nsched_before: list[int], plen_less_one: list[int],
                   computed_rows: tuple[list[int], list[int]] | None,
                   scheduled_rows: tuple[list[int], list[int]] | None,
                   out_pos: bytes, out_delta: bytes, batch: list[str],
                   nsched_map: dict[str, int],
                   ) -> tuple[list[int], list[int], list[int] | None, list[int]]:
    """(computed, outputs, scheduled counts or None for no scheduled rows, a copy of
    computed) of a same-batch step with count rows: the advance ``basis +
    nsched_before`` moved by ``computed_rows``, outputs ``max(computed - plen_less_one,
    0)`` moved by the packed output rows, ``nsched_before`` with ``scheduled_rows`` set
    (each also written to ``nsched_map`` under its id in ``batch``).  The reference of
    the C ``count_lists``, which refuses (None, nothing changed) positions out of range
    and values past int64 instead of raising."""
    computed = list(map(add, basis, nsched_before))
    if computed_rows is not None:
        for i, d in zip(*computed_rows, strict=True):
            computed[i] += d
    outputs = [max(c - p, 0) for c, p in zip(computed, plen_less_one, strict=True)]
    for i, d in zip(_ints(out_pos), unpack_sint_list(out_delta) if out_delta else [],
                    strict=True):
        outputs[i] += d
    nsched = None
    if scheduled_rows is not None:
        nsched = list(nsched_before)
        for i, v in zip(*scheduled_rows, strict=True):
            nsched[i] = nsched_map[batch[i]] = v
    return computed, outputs, nsched, list(computed)
