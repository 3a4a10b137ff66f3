"""The worker's GrammarOutput (the sample_tokens message; a part of the decoder).

Request ids travel as positions in the step's batch (names only for ids outside
it), the bitmask zero-copy, deflated, as sparse words, or as rows by reference
(:mod:`engine_side.vllm.rowrefs`); SPEC.md §16.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine_side.vllm.convert import RefTable
from engine_side.vllm.rowrefs import RowTable
from engine_side.vllm.schema import GrammarMsg, decode_frames, expand, inflate
from protocol import codec
from protocol.errors import InvalidDelta, MalformedMessage
from protocol.packing import unpack_uint_list
from worker_side.vllm.quick import vllm_types

#: a single-frame GrammarMsg (the bitmask deflated or absent): nothing for a hook to resolve
_GRAMMAR = msgspec.msgpack.Decoder(GrammarMsg, ext_hook=codec.no_tensor_frames)


def _grammar_ids(batch: list[str], msg: GrammarMsg) -> list[str]:
    """The request ids of a GrammarMsg: positions in ``batch``, then its own names."""
    if not msg.names:  # the common case: every id is in the batch
        refs = unpack_uint_list(msg.positions, limit=len(batch))
        if max(refs, default=-1) < len(batch):
            return list(map(batch.__getitem__, refs))
    return RefTable(batch, list(msg.names)).resolve(msg.positions)


def _bitmask(msg: GrammarMsg) -> Any:
    """The message's bitmask (a frame, deflated or sparse words: exactly one, or none)."""
    ways = (msg.bitmask is not None) + (msg.deflated is not None) + (msg.sparse is not None)
    if ways > 1:
        raise MalformedMessage("grammar bitmask sent more than one way")
    if msg.deflated is not None:
        return inflate(msg.deflated)
    return msg.bitmask if msg.sparse is None else expand(msg.sparse)


class GrammarDecoder:
    """GrammarOutputs of the steps a decoder decoded (the row table and the last
    step's ids are kept across steps)."""

    def __init__(self) -> None:
        self._row_table = RowTable()  # see engine_side.vllm.rowrefs
        #: (batch, packed positions, request ids) of the last GrammarMsg without names
        self._last: tuple[list[str], bytes, list[str]] = ([], b"", [])

    def decode(self, frames: list[Any], batches: dict[int, list[str]]) -> Any:
        """The GrammarOutput of a GrammarMsg's ``frames`` for a step of ``batches``;
        InvalidDelta for an unknown step, MalformedMessage for bad frames (the decoder
        answers a step without one, a single empty frame, itself)."""
        msg = decode_frames(frames, _GRAMMAR, GrammarMsg, "grammar")
        if msg.seq not in batches:
            raise InvalidDelta("grammar output for an unknown step", seq=msg.seq)
        batch, last = batches[msg.seq], self._last
        if last[0] is batch and last[1] == msg.positions and not msg.names:
            ids = list(last[2])  # the structured requests of the last step (fresh list)
        else:
            ids = _grammar_ids(batch, msg)
            if not msg.names:
                self._last = (batch, msg.positions, list(ids))
        bitmask = _bitmask(msg)
        if msg.rows is not None:  # the fresh rows and the references that rebuild it
            bitmask = self._row_table.decode(msg.rows, bitmask)
        return vllm_types()[2](ids, bitmask, msg.drafts)
