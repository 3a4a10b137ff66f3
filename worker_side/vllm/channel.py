"""A DeltaExecutor rank's end of its calls: the DEALER, plus the local step ring.

With a ring (:mod:`worker_side.ring`, the executor's default), calls arrive as ring
records ``[kind, *frames]`` and replies leave through this rank's reply ring; a call
too large for the ring comes on the DEALER behind an ON_PUB marker, a reply too
large for the reply ring leaves on the DEALER behind an ON_PUB marker in the reply
ring (the executor keeps each rank's replies in order).  Unsolicited messages
(ready, failed, check-ins) always use the DEALER.  An empty frame on the DEALER is a
doorbell: it only wakes a rank that announced it sleeps.

Without a ring: every call and reply on the DEALER, as :mod:`worker_side.vllm.proc`
documents.  Not thread-safe (the rank's main thread).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from protocol.errors import MalformedMessage
from worker_side.ring import MESSAGE, ON_PUB, RingError, RingReader, pack_frames, unpack_frames
from worker_side.transport import spin_poll

DOORBELL = b""
_BLOCK_MS = 1000  # a sleeping rank re-checks the ring at least this often


class RankChannel:
    """``next_call()`` → ``[kind, *frames]``; ``reply(frames)``; ``send(frames)``."""

    def __init__(self, sock: zmq.Socket[bytes], ring_dir: str | None, rank: int) -> None:
        self.sock = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self.ring = RingReader(Path(ring_dir), rank) if ring_dir else None
        self._calls: deque[tuple[int, bytes]] = deque()
        self._stash: deque[list[bytes]] = deque()  # DEALER calls read while waiting
        self.spin_s = 0.0
        self._answered = 0.0  # monotonic time of the last reply: the spin runs from it

    def next_call(self) -> list[bytes]:
        """The next call, waiting as long as it takes (spinning first while steps flow);
        MalformedMessage for a ring record that is not one (the call is then lost: the
        rank answers it with an error, in its place)."""
        if self.ring is None:
            self._spin()
            return self._from_dealer()
        while not self._calls:
            self._calls.extend(self._read())
            if not self._calls:
                self._wait()
        kind, payload = self._calls.popleft()
        if kind == ON_PUB:  # the engine sent this one on our DEALER
            return self._from_dealer()
        try:
            call = [bytes(f) for f in unpack_frames(payload)]
        except ValueError as exc:
            raise MalformedMessage("a ring record that is not a call", cause=str(exc)) from exc
        if not call:
            raise MalformedMessage("a call without its kind")
        return call

    def reply(self, frames: list[Any]) -> None:
        """One call's reply (in call order)."""
        self._answered = time.monotonic()
        if self.ring is None:
            self.sock.send_multipart(frames)
            return
        if not self.ring.reply(*pack_frames(frames)):
            self.ring.reply_marker()  # too large: on the DEALER, its place kept
            self.sock.send_multipart(frames)

    def send(self, frames: list[Any]) -> None:
        """An unsolicited message (check-in) on the DEALER."""
        self.sock.send_multipart(frames)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    # -- waiting ---------------------------------------------------------------------
    def _read(self) -> list[tuple[int, bytes]]:
        assert self.ring is not None
        records = self.ring.read()
        if self.ring.overruns:  # cannot happen while the executor bounds what is in flight
            raise RingError("this rank fell a whole ring behind the executor")
        return [r for r in records if r[0] in (MESSAGE, ON_PUB)]

    def _spin(self, ready: Callable[[], bool] | None = None) -> bool:
        """Spin (sched_yield) while steps flow; True once ``ready()`` or the DEALER is."""
        left = self.spin_s - (time.monotonic() - self._answered)
        return bool(spin_poll(self._poller, left, ready)) or (ready is not None and ready())

    def _wait(self) -> None:
        """Until the ring has records: spin, then sleep on the DEALER (doorbells wake us)."""
        ring = self.ring
        assert ring is not None
        if not self._spin(ring.pending) and not ring.pending():
            if not ring.sleep(True):  # nothing came while we announced it
                self.sock.poll(_BLOCK_MS, zmq.POLLIN)
            ring.sleep(False)
        self._stash_dealer()

    def _stash_dealer(self) -> None:
        """Drop doorbells; keep calls (announced by markers we may not have read yet)."""
        while self.sock.poll(0, zmq.POLLIN):
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            if frames != [DOORBELL]:
                self._stash.append(frames)

    def _from_dealer(self) -> list[bytes]:
        if self._stash:
            return self._stash.popleft()
        while True:
            frames = self.sock.recv_multipart()
            if frames != [DOORBELL]:
                return frames
