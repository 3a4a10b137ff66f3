"""A worker's end of the local step ring (SPEC §7.6; layout and records:
:mod:`protocol.ring`): it attaches to the engine's segment, reads the steps from where
it attached and writes its rank's replies.

The engine (:mod:`engine_side.ring`) announces its segment, a memfd, in ``DIR/ring``
(``pid fd size``); a worker that connects to ``ipc://DIR`` maps ``/proc/PID/fd/FD``,
and re-attaches when the engine closed the segment or another engine took the
directory over (:meth:`RingReader.stale`).

Not thread-safe: used by one thread.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from protocol.ring import (
    MAX_RANKS,
    MESSAGE,
    ON_PUB,
    RING_FILE,
    VERSION,
    W_CLOSED,
    Layout,
    Segment,
    fence,
)


class RingError(Exception):
    """A ring file that cannot be attached (missing, foreign, or another version)."""


class RingReader:
    """A worker's end: reads the step ring from where it attached, writes its replies."""

    def __init__(self, directory: Path, rank: int) -> None:
        if not 0 <= rank < MAX_RANKS:
            raise RingError(f"rank {rank} has no reply ring (0..{MAX_RANKS - 1})")
        self.path, self.rank = directory / RING_FILE, rank
        try:
            text = self.path.read_text()
            self.identity = os.stat(self.path).st_ino, text
            pid, fd, size = (int(v) for v in text.split())
            with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
                mm = mmap.mmap(f.fileno(), size)
        except (OSError, ValueError) as exc:
            raise RingError(f"cannot attach {self.path}: {exc}") from exc
        layout = Layout.of(mm)
        if layout is None:
            mm.close()
            raise RingError(f"{self.path} is not a deltacast ring of version {VERSION}")
        self.seg = Segment(mm, layout)
        self.cursor = self.seg.ring.head()  # like a late subscriber: from now on
        self.overruns = 0

    def pending(self) -> bool:
        return self.seg.ring.head() != self.cursor

    def read(self) -> list[tuple[int, bytes]]:
        """Records since the last read; an overrun skips to the head (counted)."""
        self.cursor, records = self.seg.ring.read(self.cursor)
        if records is None:
            self.overruns += 1
            return []
        return records

    def sleep(self, sleeping: bool) -> bool:
        """Announce (or withdraw) that we block on SUB; True if records arrived meanwhile
        (then do not block)."""
        self.seg.words[Layout.sleeping_word(self.rank)] = int(sleeping)
        fence()
        return self.pending()

    def reply(self, *parts: Any) -> bool:
        """Append a reply (the concatenation of ``parts``) for the engine; False if it does
        not fit (send it on the DEALER)."""
        return self.seg.replies[self.rank].write(MESSAGE, parts)

    def reply_marker(self) -> None:
        """An ON_PUB record in our reply ring: the reply at this place went on the DEALER."""
        self.seg.replies[self.rank].write(ON_PUB, [bytes(8)])

    def stale(self) -> bool:
        """The engine closed this segment or another engine now serves the directory."""
        if self.seg.words[W_CLOSED]:
            return True
        try:
            return (os.stat(self.path).st_ino, self.path.read_text()) != self.identity
        except OSError:
            return True

    def close(self) -> None:
        self.seg.words[Layout.sleeping_word(self.rank)] = 0
        self.seg.close()
