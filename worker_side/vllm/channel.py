"""A DeltaExecutor rank's end of its calls: the DEALER, plus a step ring.

With a ring (:mod:`protocol.ring`: the executor's on its host, by default, or the
relay's on another node), calls arrive as ring records ``[head, *frames]``; a call too
large for the ring comes on the DEALER behind an ON_PUB marker.  With the executor's
ring, replies leave through this rank's reply ring, one too large for it on the
DEALER behind an ON_PUB marker in the reply ring (the executor keeps each rank's
replies in order); with a relay's (``ring_replies`` False), on the DEALER.  Unsolicited
messages (ready, failed, check-ins, requests for calls again) always use the DEALER.
A rank that stops spinning sleeps on its DEALER and its doorbell, the FIFO
``DIR/bell.RANK`` (:func:`protocol.ring.open_bell`), which the ring's writer rings
when it finds the rank's ``sleeping`` word set.  Without a ring: every call and reply
on the DEALER.

Calls are numbered (:mod:`protocol.calls`): :meth:`RankChannel.next_call` hands them
out in number order, each intact, exactly once.  A call that is missing (a later one
came first, or a ``P`` ping names a number not seen yet), damaged (its CRC does not
match) or not a call at all is asked for again (``N``) and taken from the resent
copies (``Y``), which come on the DEALER; a later call that came first waits.  A
rank cannot skip a call: its peers wait for it in the collectives.

Fault injection, for tests: ``DELTACAST_INJECT="drop:RANK:NUMBER,corrupt:RANK:NUMBER"``
makes rank RANK lose, or flip a byte of, the first copy of call NUMBER it reads.
Not thread-safe (the rank's main thread).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from protocol.calls import (
    ASK_AGAIN_S,
    CALL_HEAD,
    DONE_MAX,
    NUMBER,
    PING,
    RESEND,
    RESENT,
    done_answer,
    parse_call,
)
from protocol.errors import MalformedMessage
from protocol.ring import MESSAGE, ON_PUB, drain_bell, open_bell, pack_frames, unpack_frames
from worker_side.ring import RingError, RingReader
from worker_side.transport import spin_poll

log = logging.getLogger(__name__)
_BLOCK_MS = 1000  # a sleeping rank re-checks the ring at least this often
INJECT_ENV = "DELTACAST_INJECT"


def _injections(rank: int) -> dict[int, str]:
    """Call number -> "drop" or "corrupt", from INJECT_ENV, for ``rank``."""
    out: dict[int, str] = {}
    for item in filter(None, os.environ.get(INJECT_ENV, "").split(",")):
        what, at, number = item.split(":")
        if what not in ("drop", "corrupt"):
            raise ValueError(f"{INJECT_ENV}: unknown fault {what!r}")
        if int(at) == rank:
            out[int(number)] = what
    return out


class RankChannel:
    """``next_call()`` → ``(kind, frames)``; ``reply(frames)``; ``send(frames)``."""

    def __init__(self, sock: zmq.Socket[bytes], ring_dir: str | None, rank: int,
                 ring_replies: bool = True) -> None:
        self.sock = sock
        self.rank = rank
        self.ring_replies = ring_replies
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self.ring = RingReader(Path(ring_dir), rank) if ring_dir else None
        self._bell = -1  # our doorbell's fd (with a ring)
        if ring_dir:
            try:
                self._bell = open_bell(Path(ring_dir), rank)
            except OSError as exc:
                self.close()
                raise RingError(f"cannot open rank {rank}'s doorbell in {ring_dir}: "
                                f"{exc}") from exc
            self._poller.register(self._bell, zmq.POLLIN)
        self._calls: deque[tuple[int, bytes]] = deque()
        self._stash: deque[list[bytes]] = deque()  # DEALER calls read while waiting
        self._resent: deque[list[bytes]] = deque()  # calls sent again, in order
        self.spin_s = 0.0
        self._answered = 0.0  # monotonic time of the last reply: the spin runs from it
        self._owed = 0  # K answers held back (``reply(may_wait=True)``)
        self.expected = 1  # the next call number to hand out
        self.newest = 0  # the newest call number a ping named
        self._held: list[bytes] | None = None  # a later call that came first
        self._asked = 0.0  # when calls were last asked for again (0: none missing)
        self.recovered = 0  # calls taken from the resent copies
        self._inject = _injections(rank)

    def next_call(self) -> tuple[bytes, list[bytes]]:
        """The next call in number order, intact: (kind, frames); waits as long as it
        takes (spinning first while steps flow)."""
        while True:
            call = self._take()
            try:
                kind, number, intact = parse_call(call) if call is not None \
                    else (b"", self.expected, False)  # (missing: as the expected one, lost)
            except MalformedMessage:
                kind, number, intact = b"", self.expected, False  # damaged past its head
            if number < self.expected:
                continue  # a copy of a call already handed out
            if number > self.expected or not intact:
                if intact and self._held is None:
                    self._held = call
                self._ask()
                continue
            self.expected += 1
            self._asked = 0.0
            return kind, call[1:]  # type: ignore[index]

    def reply(self, frames: list[Any], *, may_wait: bool = False) -> None:
        """One call's answer (in call order).  ``may_wait``: a ``K`` to a step call from a
        rank that is not the output rank, which goes with the next answer, or DONE_MAX
        of them in one (SPEC §16.1)."""
        self._answered = time.monotonic()
        if may_wait:
            self._owed += 1
            if self._owed < DONE_MAX:
                return
            frames, self._owed = done_answer(self._owed), 0
        elif self._owed:
            self._answer(done_answer(self._owed))
            self._owed = 0
        self._answer(frames)

    def _answer(self, frames: list[Any]) -> None:
        if self.ring is None or not self.ring_replies:
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
        if self._bell >= 0:
            self._poller.unregister(self._bell)
            os.close(self._bell)
            self._bell = -1

    # -- which call next ---------------------------------------------------------------
    def _take(self) -> list[bytes] | None:
        """A call to check: the held one when its turn came, a resent one while calls are
        missing, else the next one that arrives (None: a ping says one is missing)."""
        held = self._held
        if held is not None and CALL_HEAD.unpack(held[0])[1] <= self.expected:
            self._held = None
            return held
        if self._asked:
            return self._from_resent()
        call = self._arriving()
        if call is None:
            return None
        number = CALL_HEAD.unpack(call[0])[1] if len(call[0]) == CALL_HEAD.size else -1
        fault = self._inject.pop(number, None)
        if fault == "drop":
            log.warning("rank %d: injected fault: call %d dropped", self.rank, number)
            return self._take()
        if fault == "corrupt":
            log.warning("rank %d: injected fault: call %d damaged", self.rank, number)
            last = bytearray(call[-1]) or bytearray(b"\0")
            last[len(last) // 2] ^= 0x5A
            return [*call[:-1], bytes(last)] if len(call) > 1 else [call[0], bytes(last)]
        return call

    def _ask(self) -> None:
        """Ask the executor for the calls from the expected one on (again every
        ASK_AGAIN_S while they do not come)."""
        now = time.monotonic()
        if now - self._asked < ASK_AGAIN_S:
            return
        if not self._asked:
            log.warning("rank %d: call %d missing or damaged: asking for it again", self.rank,
                        self.expected)
        self._asked = now
        self.sock.send_multipart([RESEND, NUMBER.pack(self.expected)])

    def _from_resent(self) -> list[bytes]:
        while not self._resent:
            if self.sock.poll(int(ASK_AGAIN_S * 1000), zmq.POLLIN):
                self._stash_dealer()
            else:
                self._ask()
        self.recovered += 1
        return self._resent.popleft()

    def _arriving(self) -> list[bytes] | None:
        """The next call from the ring or the DEALER (a ring record that is not a call
        comes back as an empty head: damaged); None when a ping names a call not seen."""
        if self.ring is None:
            self._spin()
            return self._from_dealer()
        while not self._calls:
            self._calls.extend(self._read())
            if not self._calls:
                self._wait()
                if self.newest >= self.expected and not self.ring.pending():
                    return None
        kind, payload = self._calls.popleft()
        if kind == ON_PUB:  # the engine sent this one on our DEALER
            return self._from_dealer()
        try:
            return [bytes(f) for f in unpack_frames(payload)] or [b""]
        except MalformedMessage:
            return [b""]

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
        woke = spin_poll(self._poller, left, ready)
        if woke and self._bell >= 0:
            drain_bell(self._bell)  # (a bell rung just after we stopped sleeping)
        return bool(woke) or (ready is not None and ready())

    def _wait(self) -> None:
        """Until the ring has records: spin, then sleep on the DEALER and the doorbell."""
        ring = self.ring
        assert ring is not None
        if not self._spin(ring.pending) and not ring.pending():
            # (nothing came while we announced it: sleep; read the bell that woke us)
            if not ring.sleep(True) and self._poller.poll(_BLOCK_MS):
                drain_bell(self._bell)
            ring.sleep(False)
        self._stash_dealer()

    def _file(self, frames: list[bytes]) -> bool:
        """File a DEALER message that is not a call in its place: True if it was one of
        those (ping, resent call)."""
        if frames[0] == PING:
            if len(frames) == 2 and len(frames[1]) == NUMBER.size:
                self.newest = max(self.newest, NUMBER.unpack(frames[1])[0])
            return True
        if frames[0] == RESENT:
            if len(frames) > 1:
                self._resent.append(frames[1:])
            return True
        return False

    def _stash_dealer(self) -> None:
        """File what the DEALER holds; keep calls (announced by markers we may not have
        read yet)."""
        while self.sock.poll(0, zmq.POLLIN):
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            if not self._file(frames):
                self._stash.append(frames)

    def _from_dealer(self) -> list[bytes] | None:
        """The next call on the DEALER; None when a ping names a call not seen."""
        while not self._stash:
            if self.newest >= self.expected and self.ring is None:
                return None
            if self.sock.poll(_BLOCK_MS, zmq.POLLIN):
                frames = self.sock.recv_multipart()
                if not self._file(frames):
                    return frames
        return self._stash.popleft()
