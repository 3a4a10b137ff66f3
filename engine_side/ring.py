"""The engine's end of the local step ring (SPEC §7.6; layout and records:
:mod:`protocol.ring`): it creates the segment and announces it
(:class:`protocol.ring.OwnedRing`), writes the steps and reads the workers' replies.

An ipc engine announces its memfd in ``DIR/ring`` of its private 0700 directory; a
worker that connects to ``ipc://DIR`` maps it (:mod:`worker_side.ring`).

Not thread-safe: used by one thread.
"""

from __future__ import annotations

import struct
from pathlib import Path

from protocol.ring import DEFAULT_REPLY_BYTES, DEFAULT_RING_BYTES, OwnedRing


class RingWriter(OwnedRing):
    """The engine's end: creates the segment and ``DIR/ring``; writes steps, reads replies."""

    def __init__(self, directory: Path, ring_bytes: int = DEFAULT_RING_BYTES,
                 reply_bytes: int = DEFAULT_REPLY_BYTES) -> None:
        super().__init__(directory, ring_bytes, reply_bytes)
        self.cursors = [self.seg.replies[r].head() for r in range(self.seg.layout.ranks)]
        self._seen = bytes(self.seg.reply_heads)  # the reply heads we have read up to

    def replies_pending(self) -> bool:
        return bytes(self.seg.reply_heads) != self._seen  # a copy and a memcmp: ~0.1 µs

    def replies(self) -> list[tuple[int, int, bytes]]:
        """(rank, kind, payload) of every record in the reply rings since the last call,
        in order per rank."""
        if not self.replies_pending():
            return []
        out: list[tuple[int, int, bytes]] = []
        cursors, regions = self.cursors, self.seg.replies
        for rank, head in enumerate(self.seg.reply_heads.cast("Q")):
            if head != cursors[rank]:
                cursors[rank], records = regions[rank].read(cursors[rank])
                out += [(rank, kind, payload) for kind, payload in records or ()]
        self._seen = struct.pack(f"<{len(cursors)}Q", *cursors)
        return out

    def reset(self) -> None:
        """A fresh segment of the same sizes for a new group (no worker attached)."""
        layout, directory = self.seg.layout, self.path.parent
        self.close()
        self.__init__(directory, layout.ring_bytes, layout.reply_bytes)  # type: ignore[misc]
