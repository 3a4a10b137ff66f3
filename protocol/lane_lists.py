"""A lane body's count and draft rows as Python lists (:class:`LaneRows`), unpacked once
for the steady lane (:mod:`protocol.lane`) and the adapters' same-batch paths."""

from __future__ import annotations

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
