"""The Rows columns of a Delta body (SPEC.md §7): count exceptions and per-position row
sets, read with their checks (a bad column raises :class:`InvalidDelta`) and written
from actual counts (the engine's side of SPEC §8.3 steps 6-7)."""

from __future__ import annotations

import msgspec
import numpy as np

from protocol import kernels
from protocol.columns import I64
from protocol.errors import InvalidDelta, LocalProtocolError
from protocol.membership import Membership, RowSet
from protocol.messages import MAX_BLOCK_ID, DeltaBody, Rows
from protocol.packing import pack_sints, pack_uints, unpack_sint_list, unpack_uint_list

#: count exceptions as (positions, values) lists, or None where there are none
Exceptions = tuple[list[int], list[int]] | None


def read_exceptions(rows: Rows, n: int, signed: bool) -> tuple[list[int], list[int]]:
    """Count exceptions (positions < ``n``, distinct; signed corrections or counts)."""
    pos = unpack_uint_list(rows.keys) if rows.keys else []
    values = (unpack_sint_list if signed else unpack_uint_list)(rows.values) \
        if rows.values else []
    if len(pos) != len(values) or (pos and (max(pos) >= n or len(set(pos)) != len(pos))):
        raise InvalidDelta("count exceptions must be distinct positions, one value each")
    if not signed and values and max(values) > MAX_BLOCK_ID:
        raise InvalidDelta("scheduled count out of range")
    return pos, values


def read_rowset(rows: Rows, n: int) -> RowSet:
    """A row set keyed by schedule position (< ``n``, distinct; keys absent = every
    position; counts absent = one value a row)."""
    keys = unpack_uint_list(rows.keys) if rows.keys else list(range(n))
    values = unpack_uint_list(rows.values) if rows.values else []
    counts = unpack_uint_list(rows.counts) if rows.counts else [1] * len(keys)
    if len(counts) != len(keys) or sum(counts) != len(values) \
            or (keys and (max(keys) >= n or len(set(keys)) != len(keys))):
        raise InvalidDelta("rows do not fit the schedule", rows=len(keys))
    return RowSet(keys, counts, values)


def with_exceptions(body: DeltaBody, member: Membership, counts: list[int],
                    computed: list[int] | None,
                    ) -> tuple[DeltaBody, tuple[Exceptions, Exceptions]]:
    """``body`` with the count exceptions that take the predictions to the actual
    ``counts`` and ``computed`` (the engine's side of SPEC §8.3 steps 6-7), and those
    exceptions as (positions, values) lists."""
    if body.scheduled_tokens is not None or body.computed_tokens is not None:
        raise LocalProtocolError("a body with exceptions and actual counts")
    n = member.schedule.size
    if len(counts) != n or (computed is not None and len(computed) != n):
        raise LocalProtocolError("actual counts are not one per schedule position",
                                 positions=n, counts=len(counts))
    nt = departures(counts, member.counts, signed=False)
    nc = None if computed is None else \
        departures(computed, member.predicted_computed(), signed=True)
    if nt is None and nc is None:
        return body, (None, None)
    body = msgspec.structs.replace(body, scheduled_tokens=None if nt is None else nt[0],
                                   computed_tokens=None if nc is None else nc[0])
    return body, (None if nt is None else nt[1], None if nc is None else nc[1])


def departures(actual: list[int], predicted: I64, signed: bool,
                ) -> tuple[Rows, tuple[list[int], list[int]]] | None:
    """Rows of the positions where ``actual`` departs from ``predicted``: the values
    themselves (scheduled counts) or the corrections (``signed``, computed counts); and
    the same as (positions, values) lists.  None where nothing departs."""
    at = kernels.mismatches(actual, predicted)
    if not at:
        return None
    values = [actual[p] for p in at]
    if signed:
        values = [v - int(predicted[p]) for v, p in zip(values, at, strict=True)]
        return Rows(keys=pack_uints(at), values=pack_sints(values)), (at, values)
    if min(values) < 0:
        raise LocalProtocolError("a scheduled count is negative")
    if max(values) > MAX_BLOCK_ID:
        raise LocalProtocolError("a scheduled count is out of range")
    return Rows(keys=pack_uints(at), values=pack_uints(values)), (at, values)


def all_distinct(values: I64) -> bool:
    """Whether an integer array holds no value twice."""
    if values.size <= 64:
        return len(set(values.tolist())) == values.size
    return bool(np.unique(values).size == values.size)
