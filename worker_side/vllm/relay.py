"""A node's relay: one CURVE connection to the engine for all of the node's ranks (SPEC §16.1).

The engine sends a node one copy of each message, one frame
(:func:`protocol.calls.pack_relayed` of ``[target, *frames]``, the target a rank's
identity or ``*``: every rank here).  A call for every rank goes once into the node's
own step ring (``ring_bytes`` > 0; :class:`protocol.ring.OwnedRing` in the node's
private directory, read by each rank as a local rank reads the engine's), ringing
the doorbell of each rank that announced it sleeps (its FIFO); one over
RING_CALL_LIMIT or half the ring goes to each rank on that ROUTER behind an ON_PUB
marker.  Per-rank messages, and every message without a ring, go on the ROUTER.  The
relay sends what a rank says back (its replies too: the ring's reply regions go
unused) as one frame, ``pack_relayed([its identity, *frames])``; an answer of more
frames than one relayed message holds goes as an ``E`` of the rank saying so.  Its DEALER's
identity names the node and its generation of ranks (``node<K>/<G>``): the ranks of a
restart come in a session of their own.  The relay keeps nothing it carries and reads
no more than a call's number (for the marker) and whether it is the engine's ``Q``
telling every rank the group restarts (:attr:`Relay.told_restart`: the node stops a
rank that does not exit after it): calls stay numbered and checksummed end to end, and
a rank asks the engine for a lost one as it would without.

Its link to the engine sends ZMTP heartbeats (every quarter of ``liveness_s``, lost
past it).  When the engine refuses the node's key, the handshake fails, the link drops
after its handshake (the engine gone, frozen or cut off), a restarted generation
cannot reach the engine within REACH_S, or a hello is unanswered WELCOME_S after the
handshake (another session holds the node's identity), the relay says why on stderr
and closes its ranks' endpoint: each rank's link drops, and the rank exits (status 1).
Its ranks' links carry heartbeats too (set by each rank), so a frozen node is lost to
its ranks as a frozen rank is to it.  Not thread-safe but for ``close``; the sockets
belong to the relay's thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import zmq

from protocol.calls import (
    CALL_HEAD,
    ERROR,
    HELLO,
    QUIT,
    RELAY_ALL,
    RESTART,
    RING_CALL_LIMIT,
    heartbeat_ms,
    pack_relayed,
    relay_identity,
    unpack_relayed,
)
from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.ring import MIN_BYTES, OwnedRing

REACH_S = 30.0  # a restarted generation's handshake with the engine is due within this long
WELCOME_S = 30.0  # after the handshake, a hello's answer is due within this long
_POLL_MS = 100


class Relay:
    """Relays between the engine at ``engine`` and ``ranks`` (their ``endpoint``)."""

    def __init__(self, directory: str, node: int, generation: int, engine: str,
                 curve: tuple[bytes, bytes, bytes], ranks: range, liveness_s: float,
                 restarted: bool = False, ring_bytes: int = 0) -> None:
        self.node, self.engine, self.restarted = node, engine, restarted
        self.endpoint = f"ipc://{directory}/relay{generation}"
        self.failure: str | None = None
        self.relayed = 0  # messages taken from the engine
        self.ring_calls = self.socket_calls = 0  # calls for every rank, by the way taken
        #: when the engine told every rank here that the group restarts (monotonic s)
        self.told_restart: float | None = None
        self._ranks = [b"%d" % r for r in ranks]
        #: the node's step ring (DIR/ring; None: every call on the ipc ROUTER)
        self.ring = OwnedRing(Path(directory), ring_bytes, MIN_BYTES) if ring_bytes else None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._up = self._ctx.socket(zmq.DEALER)
        self._up.setsockopt(zmq.LINGER, 0)
        self._up.setsockopt(zmq.IDENTITY, relay_identity(node, generation))
        self._up.curve_serverkey, self._up.curve_publickey, self._up.curve_secretkey = curve
        interval, timeout = heartbeat_ms(liveness_s)
        self._up.setsockopt(zmq.HEARTBEAT_IVL, interval)
        self._up.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        self.liveness_s = liveness_s
        self._monitor = self._up.get_monitor_socket()
        self._down = self._ctx.socket(zmq.ROUTER)
        self._down.setsockopt(zmq.LINGER, 0)
        self._down.bind(self.endpoint)
        self._up.connect(engine)
        wake = f"inproc://relay-wake-{id(self)}"  # close() wakes the thread at once: the
        self._wake = self._ctx.socket(zmq.PAIR)  # engine sees a node whose rank died
        self._wake.bind(wake)  # without a poll period's delay
        self._waker = self._ctx.socket(zmq.PAIR)
        self._waker.connect(wake)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="DeltaRelay")
        self._thread.start()

    # ------------------------------------------------------------ the relay's thread
    def _run(self) -> None:
        # A fault of the relay's own must not leave its ranks waiting on a relay that
        # relays no more (they would outlive the engine): it fails as a lost link does.
        try:
            self._relay()
        except Exception as exc:
            traceback.print_exc()
            self._fail(f"stopped by an internal error ({type(exc).__name__}: {exc})")
        if self.failure is not None:
            self._down.close(linger=0)  # each rank's link drops: it exits

    def _relay(self) -> None:
        poller = zmq.Poller()
        for sock in (self._up, self._down, self._monitor, self._wake):
            poller.register(sock, zmq.POLLIN)
        started, joined = time.monotonic(), 0.0  # joined: when the handshake succeeded
        hello, hello_at = False, 0.0  # a hello relayed and unanswered; since (joined)
        with contextlib.suppress(zmq.ContextTerminated):
            while not self._stop.is_set() and self.failure is None:
                events = dict(poller.poll(_POLL_MS))
                if self._up in events:
                    self._from_engine()
                    hello, hello_at = False, 0.0
                if self._down in events:
                    hello = self._to_engine() or hello
                if self._monitor in events:
                    joined = self._link_event(joined)
                now = time.monotonic()
                if hello and joined and not hello_at:
                    hello_at = now
                if self.restarted and not joined and now - started > REACH_S:
                    self._fail(f"started again after its group's restart, but the engine at "
                               f"{self.engine} cannot be reached (gone, or failed)")
                if hello_at and now - hello_at > WELCOME_S:
                    self._fail(f"connected to the engine at {self.engine}, but no answer to "
                               f"this node's hello in {WELCOME_S:.0f} s: node {self.node} is "
                               "already connected (one session per key), or the engine is "
                               "not waiting for it")

    def _from_engine(self) -> None:
        while True:
            try:
                message = self._up.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                if len(message) != 1:
                    raise MalformedMessage("a relayed message is one frame")
                target, *frames = unpack_relayed(message[0].buffer)
            except MalformedMessage as exc:  # (the engine's fault: CURVE vouches for it)
                print(f"deltacast node {self.node}: dropped a malformed message from the "
                      f"engine ({exc})", file=sys.stderr, flush=True)
                continue
            self.relayed += 1
            if target == RELAY_ALL and frames[0][:1] == QUIT and len(frames) == 2 \
                    and frames[1] == RESTART:  # (a rank hung in a step never reads it)
                self.told_restart = time.monotonic()
            if target == RELAY_ALL and self._ring_write(frames):
                continue
            for rank in self._ranks if target == RELAY_ALL else [bytes(target)]:
                with contextlib.suppress(zmq.ZMQError):  # (a rank not here: dropped)
                    self._down.send_multipart([rank, *frames], copy=False)

    def _ring_write(self, frames: list[Any]) -> bool:
        """A call for every rank into the ring, its sleepers woken: True; False when it
        goes on the ROUTER (no ring; or too large: behind its marker, its place kept)."""
        ring = self.ring
        if ring is None:
            return False
        head = frames[0] if frames else b""
        number = CALL_HEAD.unpack(head)[1] if len(head) == CALL_HEAD.size else 0
        if not ring.publish(frames, number, RING_CALL_LIMIT):
            self.socket_calls += 1
            return False
        self.ring_calls += 1
        ring.wake()
        return True

    def _to_engine(self) -> bool:
        """Relay what ranks said; True if one said hello."""
        hello = False
        while True:
            try:
                parts = self._down.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return hello
            hello = hello or (len(parts) > 1 and parts[1].bytes[:1] == HELLO)
            try:
                payload = pack_relayed([p.buffer for p in parts])
            except LocalProtocolError as exc:  # its answer cannot cross: an E in its place
                rank = parts[0].bytes.decode(errors="replace")
                print(f"deltacast node {self.node}: rank {rank} answered with more than a "
                      f"relayed message holds ({exc})",
                      file=sys.stderr, flush=True)
                payload = pack_relayed([parts[0].buffer, ERROR,
                                        f"{type(exc).__name__}: {exc}".encode()])
            self._up.send(payload, copy=False)

    def _link_event(self, joined: float) -> float:
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(self._monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return time.monotonic()
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._fail(f"the engine at {self.engine} refused this node's CURVE key (is its "
                       "public key among the engine's workerK.key for this node?)")
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                       zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL) and not joined:
            self._fail(f"no CURVE handshake with {self.engine}: wrong engine.key for this "
                       "engine, or not a deltacast engine")
        elif event == zmq.EVENT_DISCONNECTED and joined:
            self._fail(f"lost the engine at {self.engine} (gone, frozen, or cut off: no "
                       f"heartbeat for {self.liveness_s:g} s)")
        return joined

    def _fail(self, why: str) -> None:
        if self.failure is None and not self._stop.is_set():
            self.failure = why
            print(f"deltacast node {self.node}: {why}; its ranks exit", file=sys.stderr,
                  flush=True)

    # ------------------------------------------------------------ any thread
    def close(self) -> None:
        """Stop relaying; the engine sees this node's link drop at once.  Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.send(b"")
        self._thread.join(2.0)
        if self._thread.is_alive():  # (its sockets are left to the process's exit)
            return
        self._up.disable_monitor()
        for sock in (self._monitor, self._up, self._down, self._wake, self._waker):
            sock.close(linger=0)
        self._ctx.term()
        if self.ring is not None:
            self.ring.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
