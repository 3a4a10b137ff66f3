"""Engine side of ``sample_tokens``: vLLM's GrammarOutput → one GrammarMsg (frames).

Request ids travel as positions in the step's batch (names only for an id outside
it); the bitmask by row reference, deflated, as sparse words or as a zero-copy tensor
frame, whichever the rows allow (:mod:`protocol.bitmask`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.bitmask import GrammarMsg, RowTable, compact_ways
from protocol.codec import Frame
from protocol.ext import RefTable
from protocol.packing import pack_uints
from protocol.tensors import make_enc_hook


class GrammarEncoder:
    """Stateful GrammarOutput → frames (its row table and last positions carry over)."""

    def __init__(self) -> None:
        self._aux: list[Any] = []
        self._enc = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(self._aux))
        self._rows = RowTable()
        #: (positions map, grammar ids, their packed positions) of the last output
        self._last: tuple[dict[str, int] | None, list[str], bytes] = (None, [], b"")

    def encode(self, grammar: Any, seq: int, batch: list[str],
               pos: dict[str, int]) -> list[Frame]:
        """The frames of a GrammarOutput for step ``seq`` of ``batch`` (``pos``: its
        positions by id, an object kept while the batch is)."""
        ids = grammar.structured_output_request_ids
        names: tuple[str, ...] = ()
        last = self._last
        if last[0] is pos and last[1] == ids:
            positions = last[2]  # the same structured requests as the last step
        else:
            try:
                positions = pack_uints([pos[r] for r in ids])
                self._last = (pos, list(ids), positions)
            except KeyError:  # an id outside the batch: named
                refs = RefTable(batch, [])
                positions, names = refs.pack(ids), tuple(refs.names)
        bitmask, rows = grammar.grammar_bitmask, None
        by_ref = self._rows.encode(bitmask)
        if by_ref is not None:
            bitmask = None
            rows, deflated, sparse = by_ref
        else:
            deflated, sparse = compact_ways(bitmask)
        if deflated is not None or sparse is not None:
            bitmask = None
        msg = GrammarMsg(seq, positions, names, bitmask, grammar.num_acceptable_drafts,
                         deflated, sparse, rows)
        self._aux.clear()
        try:
            return [self._enc.encode(msg), *self._aux]
        finally:
            self._aux.clear()
