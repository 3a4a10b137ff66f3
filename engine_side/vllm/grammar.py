"""Engine side of ``sample_tokens``: vLLM's GrammarOutput → one GrammarMsg (frames).

Request ids travel as positions in the step's batch (names only for an id outside
it); the bitmask goes by row reference (:mod:`.rowrefs`), deflated, as sparse words
or as a zero-copy tensor frame, whichever the rows allow.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine_side.vllm.convert import RefTable
from engine_side.vllm.quick import QuickEncoder
from engine_side.vllm.rowrefs import RowTable
from engine_side.vllm.schema import GrammarMsg, compact_ways
from protocol.codec import Frame
from protocol.packing import pack_uints
from protocol.tensors import make_enc_hook


class GrammarEncoder:
    """Stateful GrammarOutput → frames (its row table and last positions carry over)."""

    def __init__(self) -> None:
        self._aux: list[Any] = []
        self._enc = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(self._aux))
        self._row_table = RowTable()  # see engine_side.vllm.rowrefs
        #: (batch, grammar ids, their packed positions) of the last GrammarOutput
        self._last_positions: tuple[list[str], list[str], bytes] = ([], [], b"")

    def encode(self, grammar: Any, seq: int, batch: list[str],
               quick: QuickEncoder) -> list[Frame]:
        """The frames of a GrammarOutput for step ``seq`` of ``batch`` (the encoder answers
        a step without one, None, itself: one empty frame)."""
        ids = grammar.structured_output_request_ids
        names: tuple[str, ...] = ()
        positions = self._positions(ids, batch, quick)
        if positions is None:  # an id outside the batch: named
            refs = RefTable(batch, [])
            positions, names = refs.pack(ids), tuple(refs.names)
        bitmask, rows = grammar.grammar_bitmask, None
        by_ref = self._row_table.encode(bitmask)  # repeated rows as references
        if by_ref is not None:
            bitmask = None
            rows, deflated, sparse = by_ref
        else:
            deflated, sparse = compact_ways(bitmask)
        if deflated is not None or sparse is not None:
            bitmask = None
        msg = GrammarMsg(seq, positions, names, bitmask,
                         grammar.num_acceptable_drafts, deflated, sparse, rows)
        self._aux.clear()
        try:
            return [self._enc.encode(msg), *self._aux]
        finally:
            self._aux.clear()

    def _positions(self, ids: Any, batch: list[str], quick: QuickEncoder) -> bytes | None:
        """``ids`` packed as positions in ``batch`` through the quick encoder's map of it
        (kept for the batch of every step); None when one is not in it.  The last
        answer is kept: structured requests stay the same over a batch's steps."""
        if quick.batch is not batch or not isinstance(ids, list):
            return None
        last = self._last_positions
        if last[0] is batch and last[1] == ids:
            return last[2]
        try:
            packed = pack_uints(list(map(quick.pos.__getitem__, ids)))
        except KeyError:
            return None
        self._last_positions = (batch, list(ids), packed)
        return packed
