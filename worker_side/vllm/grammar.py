"""Worker side of ``sample_tokens``: one GrammarMsg → vLLM's GrammarOutput.

Request ids travel as positions in the step's batch (names only for ids outside it),
the bitmask zero-copy, deflated, as sparse words, or as rows by reference
(:mod:`protocol.bitmask`); SPEC.md §16.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from protocol.bitmask import GrammarMsg, RowTable, expand, inflate
from protocol.codec import no_tensor_frames
from protocol.errors import InvalidDelta, MalformedMessage
from protocol.ext import RefTable, decode_frames
from protocol.packing import unpack_uint_list

#: a single-frame GrammarMsg (the bitmask deflated or absent)
_GRAMMAR = msgspec.msgpack.Decoder(GrammarMsg, ext_hook=no_tensor_frames)


def _bitmask(msg: GrammarMsg) -> Any:
    """The message's bitmask (a frame, deflated or sparse words: exactly one, or none)."""
    ways = (msg.bitmask is not None) + (msg.deflated is not None) + (msg.sparse is not None)
    if ways > 1:
        raise MalformedMessage("grammar bitmask sent more than one way")
    if msg.deflated is not None:
        return inflate(msg.deflated)
    return msg.bitmask if msg.sparse is None else expand(msg.sparse)


class GrammarDecoder:
    """GrammarOutputs of the steps a decoder decoded (row table and last ids kept)."""

    def __init__(self) -> None:
        self._rows = RowTable()
        #: (batch, packed positions, request ids) of the last message without names
        self._last: tuple[list[str] | None, bytes, list[str]] = (None, b"", [])

    def decode(self, frames: list[Any], batches: dict[int, list[str]]) -> Any:
        """The GrammarOutput of ``frames`` for a step of ``batches``; InvalidDelta for an
        unknown step, MalformedMessage for bad frames."""
        from vllm.v1.core.sched.output import GrammarOutput

        msg = decode_frames(frames, _GRAMMAR, GrammarMsg, "grammar")
        batch = batches.get(msg.seq)
        if batch is None:
            raise InvalidDelta("grammar output for an unknown step", seq=msg.seq)
        last = self._last
        if last[0] is batch and last[1] == msg.positions and not msg.names:
            ids = list(last[2])
        else:
            refs = unpack_uint_list(msg.positions, limit=len(batch) + len(msg.names))
            if not msg.names and max(refs, default=-1) < len(batch):
                ids = list(map(batch.__getitem__, refs))
                self._last = (batch, msg.positions, list(ids))
            else:
                ids = RefTable(batch, list(msg.names)).names_of(refs)
        bitmask = _bitmask(msg)
        if msg.rows is not None:
            bitmask = self._rows.decode(msg.rows, bitmask)
        if type(bitmask) is not np.ndarray or bitmask.dtype.kind not in "iu":
            # (vLLM's runner indexes an integer array: anything else fails there)
            raise MalformedMessage("grammar bitmask: not an integer array",
                                   got=type(bitmask).__name__)
        return GrammarOutput(ids, bitmask, msg.drafts)
