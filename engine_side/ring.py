"""The engine's end of the local step ring (SPEC §7.6; layout and records:
:mod:`protocol.ring`): it creates the segment and announces it, writes the steps and
reads the workers' replies.

An ipc engine creates one memfd (no name in /dev/shm: the kernel frees it when the
last process mapping it exits, even after kill -9) and writes ``pid fd size`` to
``DIR/ring`` in its private 0700 directory; a worker that connects to ``ipc://DIR``
maps ``/proc/PID/fd/FD`` (:mod:`worker_side.ring`).

Not thread-safe: used by one thread.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protocol.ring import (
    DEFAULT_REPLY_BYTES,
    DEFAULT_RING_BYTES,
    MESSAGE,
    MIN_BYTES,
    ON_PUB,
    RING_FILE,
    W_CLOSED,
    Layout,
    Segment,
    fence,
    pack_frames,
)

_U64 = struct.Struct("<Q")


class RingWriter:
    """The engine's end: creates the segment and ``DIR/ring``; writes steps, reads replies."""

    def __init__(self, directory: Path, ring_bytes: int = DEFAULT_RING_BYTES,
                 reply_bytes: int = DEFAULT_REPLY_BYTES) -> None:
        if ring_bytes < MIN_BYTES or ring_bytes % 8 or reply_bytes < MIN_BYTES or reply_bytes % 8:
            raise ValueError(f"ring and reply sizes must be multiples of 8, at least {MIN_BYTES}")
        layout = Layout(ring_bytes, reply_bytes)
        self.fd = os.memfd_create("deltacast-ring", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, layout.size)
        self.seg = Segment(mmap.mmap(self.fd, layout.size), layout)
        self.seg.format()
        self.path = directory / RING_FILE
        tmp = directory / f".{RING_FILE}.{os.getpid()}"
        tmp.write_text(f"{os.getpid()} {self.fd} {layout.size}\n")
        tmp.chmod(0o600)
        tmp.replace(self.path)  # atomically: a worker never reads a half-written file
        self.cursors = [self.seg.replies[r].head() for r in range(layout.ranks)]
        self._seen = bytes(self.seg.reply_heads)  # the reply heads we have read up to

    def publish(self, frames: Sequence[Any], seq: int, limit: int | None = None) -> bool:
        """Append one message; if it is too large (for the ring, or than ``limit``), an
        ON_PUB marker for ``seq`` instead (returns False: the caller MUST then send the
        message on its socket)."""
        if self.seg.ring.write(MESSAGE, pack_frames(frames), limit):
            return True
        self.seg.ring.write(ON_PUB, [_U64.pack(seq)])
        return False

    def sleepers(self) -> bool:
        """Whether a reader has announced it is blocking (send a doorbell; after a fence)."""
        fence()
        return self.seg.sleeping_any()

    def sleeping_ranks(self) -> list[int]:
        """Ranks whose worker announced it blocks (after a fence)."""
        fence()
        return [r for r, v in enumerate(self.seg.sleeping.cast("Q")) if v]

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

    def close(self) -> None:
        """Mark the segment closed (attached workers re-attach) and remove ``DIR/ring``."""
        if self.fd < 0:
            return
        self.seg.words[W_CLOSED] = 1
        with contextlib.suppress(OSError):
            if self.path.read_text().split()[:2] == [str(os.getpid()), str(self.fd)]:
                self.path.unlink()
        self.seg.close()
        os.close(self.fd)
        self.fd = -1
