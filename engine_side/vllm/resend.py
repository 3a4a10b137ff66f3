"""The DeltaExecutor's retransmit buffer: the last calls it sent, for a rank that lost one.

A vLLM rank cannot skip a step (its peers wait for it in the collectives and its KV
cache would miss the step), so a rank that finds a call missing or damaged asks for
it again (SPEC §16: ``N`` with the first call number it lacks) and the executor sends
that call and every later one again from here (``Y``, in order).  The buffer keeps
the last :data:`RESEND_CALLS` calls, at most :data:`RESEND_BYTES` of them: a rank
that lacks an older one cannot recover, and the executor fails cleanly naming it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

from protocol import calls as wire
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.faults import PeerFaults

log = logging.getLogger(__name__)

RESEND_CALLS = 64  # calls kept for retransmission (the executor keeps a few in flight)
RESEND_BYTES = 256 << 20  # and at most this many bytes of them (the newest always kept)
#: an N for calls sent again to that rank less than this long before is dropped (counted):
#: a rank repeats its request only every ASK_AGAIN_S, so only a rank that asks in a loop
#: loses one; each answer may be RESEND_CALLS calls of up to RESEND_BYTES
RESEND_QUIET_S = wire.ASK_AGAIN_S / 2


class CallLog:
    """The last calls sent, by call number (each ``[head, *frames]`` as sent; the frames
    are kept alive, not copied)."""

    def __init__(self, calls: int = RESEND_CALLS, max_bytes: int = RESEND_BYTES) -> None:
        self.calls, self.max_bytes = calls, max_bytes
        self._kept: deque[tuple[int, list[Any], int]] = deque()  # number, call, bytes
        self._bytes = 0

    def record(self, number: int, call: list[Any]) -> None:
        size = sum(memoryview(f).nbytes for f in call)
        self._kept.append((number, call, size))
        self._bytes += size
        while len(self._kept) > self.calls or (self._bytes > self.max_bytes
                                               and len(self._kept) > 1):
            self._bytes -= self._kept.popleft()[2]

    def since(self, first: int) -> list[list[Any]] | None:
        """Calls ``first``, ``first + 1``, ... up to the newest; None when ``first`` is no
        longer kept (or was never sent)."""
        kept = self._kept
        if not kept or not kept[0][0] <= first <= kept[-1][0]:
            return None
        return [call for number, call, _ in kept if number >= first]

    @property
    def oldest(self) -> int:
        """The oldest call number kept (0: none)."""
        return self._kept[0][0] if self._kept else 0


class Retransmitter:
    """Calls sent again with ``send(rank, frames)``: ``resend`` answers a rank's
    ``N``, ``ping`` tells ranks that owe an answer the newest call number."""

    def __init__(self, send: Callable[[int, list[Any]], None], stats: Counter[str],
                 faults: PeerFaults) -> None:
        self.send, self.stats, self.faults = send, stats, faults
        self.sent = CallLog()
        self.newest = 0
        self._answered: dict[int, tuple[int, float]] = {}  # rank -> (newest resent, when)

    def record(self, number: int, call: list[Any]) -> None:
        self.sent.record(number, call)
        self.newest = number

    def resend(self, rank: int, frames: list[bytes]) -> str | None:
        """Answer ``rank``'s request (``frames`` after its kind): the calls it lacks, in
        order.  Returns why the rank cannot recover (its calls are no longer kept), else
        None; a malformed request is dropped and counted."""
        try:
            first = wire.parse_number(frames[0] if len(frames) == 1 else b"")
        except ProtocolError as exc:
            self.faults.hit(f"rank {rank}", exc)
            return None
        now = time.monotonic()
        resent, when = self._answered.get(rank, (0, 0.0))
        if first <= resent and now - when < RESEND_QUIET_S:
            self.faults.hit(f"rank {rank}", RemoteProtocolError(
                "asked again for calls just sent again", first=first))
            return None
        calls = self.sent.since(first)
        if calls is None:
            return (f"rank {rank} lacks call {first}, which is no longer kept for "
                    f"retransmission (oldest kept: {self.sent.oldest}, newest sent: "
                    f"{self.newest})")
        self.stats["resent_calls"] += len(calls)
        self._answered[rank] = (self.newest, now)
        try:
            for call in calls:
                self.send(rank, [wire.RESENT, *call])
        except zmq.ZMQError:  # the rank is gone: its process watch reports that
            return None
        log.warning("DeltaExecutor rank %d lacked call %d: sent %d call(s) again", rank,
                    first, len(calls))
        return None

    def ping(self, ranks: list[int]) -> None:
        """Tell ``ranks`` (they owe an answer) the newest call number: a rank that lost
        the newest call finds out so; one still working on it ignores this."""
        newest = wire.NUMBER.pack(self.newest)
        for rank in ranks:
            with contextlib.suppress(zmq.ZMQError):  # a rank gone: found by its watch
                self.send(rank, [wire.PING, newest])
