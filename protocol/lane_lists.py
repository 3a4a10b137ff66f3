"""A lane body's count and draft rows as Python lists (:class:`LaneRows`), unpacked once
for the steady lane (:mod:`protocol.lane`) and the adapters' same-batch paths; which
bodies are the lane's (:func:`lane_shaped`); and the list arithmetic both use."""

from __future__ import annotations

from operator import attrgetter, mul
from typing import NamedTuple

from protocol.errors import MalformedMessage
from protocol.messages import DeltaBody
from protocol.packing import unpack_sint_list, unpack_uint_list, unpack_uint_list_minus_one
from protocol.speedups import C as _C


class LaneRows(NamedTuple):
    """A lane body's count exceptions and speculative-token rows as Python lists."""

    #: (positions, signed corrections) of ``computed_tokens``; None: absent
    computed: tuple[list[int], list[int]] | None = None
    #: (positions, counts) of ``scheduled_tokens``; None: absent
    scheduled: tuple[list[int], list[int]] | None = None
    #: ``spec_tokens``: tokens per scheduled position and the flat token ids (the wire
    #: carries each plus one); None: absent
    drafts: tuple[list[int], list[int]] | None = None

    def fits(self, n: int) -> bool:
        """The checks of ``_Planner.exceptions`` and ``_Planner.aligned`` on a schedule of
        ``n``: exception positions distinct and scheduled, as many as values; one draft
        count per position, as many values as they sum to."""
        for pair in (self.computed, self.scheduled):
            if pair is not None:
                pos, vals = pair
                if len(pos) != len(vals) or (pos and max(pos) >= n) or len(set(pos)) != len(pos):
                    return False
        return self.drafts is None or (
            len(self.drafts[0]) == n and sum(self.drafts[0]) == len(self.drafts[1]))


NO_ROWS = LaneRows()  # a lane body without count exceptions or drafts


def lane_rows(body: DeltaBody, n: int) -> LaneRows | None:
    """The :class:`LaneRows` of a :func:`lane_shaped` ``body`` on a schedule of ``n``
    (unpacked once); None when a field does not unpack (the state's own path raises it,
    typed) or has handles where the lane takes schedule-aligned rows."""
    computed, scheduled, spec = body.computed_tokens, body.scheduled_tokens, body.spec_tokens
    if computed is None and scheduled is None and spec is None:
        return NO_ROWS
    got = None if _C is None else _C.lane_rows(computed, scheduled, spec, n)  # one C call
    if got is not None:
        return LaneRows(*got)
    try:
        drafts = None
        if spec is not None:
            if spec.handles:
                return None
            drafts = (unpack_uint_list(spec.counts) if spec.counts else [1] * n,
                      unpack_uint_list_minus_one(spec.values))
        return LaneRows(
            None if computed is None else (_uints(computed.handles),
                                           unpack_sint_list(computed.values)),
            None if scheduled is None else (_uints(scheduled.handles), _uints(scheduled.values)),
            drafts)
    except MalformedMessage:
        return None


def _uints(packed: bytes) -> list[int]:
    return unpack_uint_list(packed) if packed else []


#: the fields a lane body leaves empty, read by one C call (see lane_shaped)
_SCHEDULE_FIELDS = attrgetter(
    "finished", "finished_unknown", "added", "schedule_full", "schedule_drop",
    "schedule_append", "block_replace", "truncate", "tokens", "encoder_inputs", "preempted",
    "resumed", "free_encoder_mm_hashes", "blocks_to_zero")
_UNSET = _SCHEDULE_FIELDS(DeltaBody())


def lane_shaped(body: DeltaBody) -> bool:
    """Whether ``body`` keeps the schedule, changing only count exceptions, block appends
    and step-only fields (the lane's bodies)."""
    if _SCHEDULE_FIELDS(body) == _UNSET:  # the common case, in one compare
        return True
    return (not body.finished and not body.finished_unknown and not body.added
            and not body.schedule_full and not body.schedule_drop
            and not body.schedule_append and not body.block_replace
            and body.truncate is None and body.tokens is None
            and body.encoder_inputs is None and not body.preempted and not body.resumed
            and not body.free_encoder_mm_hashes and not body.blocks_to_zero)


def dot(values: list[int], keys: list[int], at: list[int] | None = None) -> int:
    """``sum(values[j] * keys[at[j]])`` (``keys[j]`` without ``at``), equal mod 2**64 --
    all the digest keeps of it -- in C or in Python."""
    if _C is not None:
        total: int | None = _C.dot(values, keys, at)
        if total is not None:
            return total
    return sum(map(mul, values, keys if at is None else map(keys.__getitem__, at)))


def add_at(target: list[int], at: list[int], values: list[int]) -> None:
    """``target[at[j]] += values[j]`` for each j (one C call when it takes them)."""
    if _C is None or _C.add_at(target, at, values) is None:  # None: nothing done
        for p, d in zip(at, values, strict=True):
            target[p] += d


def rows_fit(pos: list[int], counts: list[int], ids: int, n: int) -> bool:
    """Appended rows at distinct scheduled positions (``n`` scheduled), >= 1 id each,
    ``ids`` in all."""
    if len(pos) == 1:  # the common case: one row, on scalars
        return len(counts) == 1 and 0 <= pos[0] < n and 1 <= counts[0] == ids
    return len(counts) == len(pos) and len(set(pos)) == len(pos) and min(pos) >= 0 \
        and max(pos) < n and min(counts) >= 1 and sum(counts) == ids
