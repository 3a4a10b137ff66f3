"""Computed counts of the next few steady steps, made by one numpy call.

A steady step (the empty delta) advances every scheduled request's computed count by
its scheduled count.  Doing that ``+`` per step is the costliest part of a steady step
on a cold cache (numpy's ufunc machinery), so :class:`Lookahead` computes
``base + j * nsched`` for the next ``j = 1..steps`` at once: each step then takes a
row (the state's private copy, a row for the rebuilt request, and the row's bytes for
the mirror's comparison).  Rows wrap modulo 2**64 exactly like repeated additions.
"""

from __future__ import annotations

import numpy as np

from protocol.request import IntArray

MAX_STEPS = 16  # rows per table
MAX_VALUES = 1 << 15  # ... and at most this many counts per table (large batches)


class Lookahead:
    """Rows ``base + j * nsched`` (j = 1..steps) for one schedule and its counts."""

    __slots__ = ("schedule", "nsched", "private", "public", "data", "row_bytes", "next")

    def __init__(self, base: IntArray, schedule: IntArray, nsched: IntArray) -> None:
        steps = max(1, min(MAX_STEPS, MAX_VALUES // max(1, schedule.size)))
        table = base + np.multiply.outer(np.arange(1, steps + 1, dtype=np.int64), nsched)
        self.schedule, self.nsched = schedule, nsched
        # row views made here, not per step: rows handed out (once each) by rebuilt
        # requests, and read-only rows the state keeps
        self.public: list[IntArray] = list(table.copy())
        table.flags.writeable = False
        self.private: list[IntArray] = list(table)
        self.data = table.tobytes()
        self.row_bytes = schedule.size * 8
        self.next = 0  # the row of the next advance

    def fits(self, schedule: IntArray, nsched: IntArray) -> bool:
        return (self.schedule is schedule and self.nsched is nsched
                and self.next < len(self.private))

    def prediction(self) -> bytes:
        """The next row's int64 bytes (compared with the engine's request)."""
        start = self.next * self.row_bytes
        return self.data[start:start + self.row_bytes]
