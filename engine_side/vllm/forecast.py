"""The counts a batch's next steps will have if nothing departs (:class:`Forecast`).

Both ends of the same-batch step (:mod:`engine_side.vllm.quick`,
:mod:`worker_side.vllm.quick`) keep the same forecast: each scheduled request's
computed count advances by its scheduled count, and ``num_output_tokens`` is
``computed - prompt + 1`` (at least 0), exactly the predictions of the general path.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import add, ne, sub
from typing import Any

import numpy as np

from protocol.speedups import C as _C

SMALL = 32  # batches up to this size predict with Python lists, larger ones with numpy
ROWS = 8  # steps a numpy forecast covers


class Forecast:
    """Predicted computed and output counts of one batch for its next steps.

    Rows ``j = 1..`` advance ``computed`` by ``j * nsched``; a row is valid while
    every step before it matched its own row and kept ``nsched``.  The first row
    after a restart is made alone, then :data:`ROWS` rows at a time by one C call
    (``forecast_rows``); without the speedups, batches over :data:`SMALL` get a numpy
    table of :data:`ROWS` rows and smaller ones a row at a time.
    """

    __slots__ = ("plen", "plen_np", "plen_less_one", "nsched", "total", "comp_rows", "out_rows",
                 "next", "_last", "_base", "_decoding")

    def __init__(self, plen: list[int]) -> None:
        self.plen = plen
        # numpy tables: large batches without the C rows (which take any batch)
        self.plen_np = np.array(plen, dtype=np.int64) if len(plen) > SMALL and _C is None \
            else None
        # outputs = max(computed - plen + 1, 0)
        self.plen_less_one = list(map(sub, plen, repeat(1)))
        self.nsched: list[int] = []
        self.total = 0  # sum(nsched)
        self.comp_rows: list[list[int]] = []
        self.out_rows: list[list[int]] = []
        self.next = 0
        self._last: Any = None  # numpy base of the next table (large batches)
        self._base: list[int] = []  # the counts the first row advances from
        #: every output count of the last row and every scheduled count is >= 0, so rows
        #: advancing from it need no clamp (reset by restart)
        self._decoding = False

    def kept(self, keep: list[bool]) -> Forecast:
        """A forecast of the requests at the positions ``keep`` marks, predicting their
        next step as this one predicts it (the batch less some requests)."""
        fc = Forecast.__new__(Forecast)
        fc.plen = list(compress(self.plen, keep))
        fc.plen_np = None if self.plen_np is None else self.plen_np[keep]
        fc.plen_less_one = list(compress(self.plen_less_one, keep))
        fc.restart(list(compress(self.basis(), keep)), list(compress(self.nsched, keep)))
        return fc

    def restart(self, computed: list[int], nsched: list[int], total: int | None = None,
                ) -> None:
        """Predict from actual ``computed`` and ``nsched`` lists (``total``: their sum when
        the caller knows it; the rows are made when :meth:`take` first needs them: a
        general step that follows never pays for them)."""
        self.nsched, self._last = nsched, None
        self.total = sum(nsched) if total is None else total
        self._base, self.comp_rows, self.out_rows, self.next = computed, [], [], 0
        self._decoding = False

    def take(self) -> tuple[list[int], list[int]]:
        """(computed, outputs) predicted for the next step (shared lists: copy to keep)."""
        if self.next >= len(self.comp_rows):
            self._build(self.comp_rows[-1] if self.comp_rows else self._base)
        return self.comp_rows[self.next], self.out_rows[self.next]

    def advanced(self) -> None:
        """The step just taken matched its prediction and kept ``nsched``."""
        self.next += 1

    def basis(self) -> list[int]:
        """The computed counts the next step's prediction advances from by ``nsched``."""
        return self.comp_rows[self.next - 1] if self.next else self._base

    def rebase(self, computed: list[int], nsched: list[int], same_ns: bool,
               total: int | None = None) -> None:
        """:meth:`restart`, keeping the total when ``nsched`` is unchanged (``total``:
        the new one's sum when the caller knows it)."""
        if not same_ns:
            self.nsched, self.total = nsched, sum(nsched) if total is None else total
        self._base, self.comp_rows, self.out_rows, self.next = computed, [], [], 0
        self._last, self._decoding = None, False

    def outputs(self, computed: list[int]) -> list[int]:
        """``max(computed - plen + 1, 0)`` per request of the batch."""
        return past_prompt(computed, self.plen_less_one)

    def _build(self, computed: list[int]) -> None:
        ns, self.next = self.nsched, 0
        if _C is not None:  # the rows in one pass: making their ints is the whole cost
            # (the first row after a restart alone, as below)
            got = _C.forecast_rows(computed, ns, self.plen_less_one,
                                   ROWS if self.comp_rows else 1)
            if got is not None:
                self.comp_rows, self.out_rows = got
                self._last = None
                return
        # C-level maps, one row: small batches, and the first row after a restart (a
        # batch whose counts keep changing would pay for a table it never uses)
        if self.plen_np is None or not self.comp_rows:
            row = list(map(add, computed, ns))
            outs = list(map(sub, row, self.plen_less_one))
            if not self._decoding:  # once no output count is negative, none becomes so
                if min(outs, default=0) < 0:
                    outs = list(map(max, outs, repeat(0)))
                else:
                    self._decoding = min(ns, default=0) >= 0
            self.comp_rows, self.out_rows = [row], [outs]
            return
        base = self._last if self._last is not None else np.array(computed, dtype=np.int64)
        table = base + np.multiply.outer(np.arange(1, ROWS + 1, dtype=np.int64),
                                         np.array(ns, dtype=np.int64))
        self._last = table[-1]
        self.comp_rows = table.tolist()
        self.out_rows = np.maximum(table - (self.plen_np - 1), 0).tolist()


def past_prompt(computed: list[int], plen_less_one: list[int]) -> list[int]:
    """Output counts ``max(computed - plen + 1, 0)`` per request (C-level maps; the clamp
    only while some request is still in its prompt)."""
    outs = list(map(sub, computed, plen_less_one))
    return list(map(max, outs, repeat(0))) if min(outs, default=0) < 0 else outs


def changed(new: list[int], old: list[int]) -> list[int]:
    """Positions where two equally long lists differ (C-level maps; the caller checks
    the lengths)."""
    return list(compress(range(len(new)), map(ne, new, old)))
