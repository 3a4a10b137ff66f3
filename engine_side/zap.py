"""The engine's ZAP handler (ZeroMQ RFC 27): admits exactly the allowed CURVE keys.

libzmq asks it, on ``inproc://zeromq.zap.01`` of the engine's context, about every CURVE
handshake that completed its cryptography (in libzmq's I/O thread, no interpreter lock).
It answers from its own thread with as little Python per request as the protocol allows
(raw 32-byte keys in a set, every queued request answered in one pass), so a flood of
handshakes with unknown keys costs the step loop's interpreter a few microseconds per
handshake, not pyzmq's general authenticator's ~100 µs.

Answers: CURVE with an allowed key: 200 with the key's z85 text as the User-Id (the
transport's principal); CURVE with any other key: 400, counted (:attr:`rejected`), the
first logged, then one in 10,000 (a flood must not become a log flood); NULL (a socket
that asked for ZAP without CURVE): 200; anything else: 400.
"""

from __future__ import annotations

import logging
import threading

import zmq
from zmq.utils import z85

log = logging.getLogger("deltacast.zap")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27
_POLL_MS = 100  # how often the thread looks at its stop flag


class ZapHandler:
    """A running ZAP handler on ``ctx`` for the z85 public keys ``allowed``;
    :meth:`stop` ends it."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], allowed: frozenset[bytes]) -> None:
        self.allowed = {z85.decode(k): k for k in allowed}
        self.rejected = 0
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)  # before any CURVE socket binds: none goes unasked
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltacast-zap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and close the socket (again: nothing); :attr:`rejected` stays."""
        if self._sock.closed:
            return
        self._stopping.set()
        self._thread.join()
        self._sock.close(linger=0)

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stopping.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                while True:  # every request queued, in one pass
                    try:
                        request = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sock.send_multipart(self.answer(request))
        except zmq.ContextTerminated:  # the context is ending first: let it end
            sock.close(linger=0)

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The reply frames to one ZAP request's frames."""
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400",
                    b"malformed ZAP request", b"", b""]
        rid, mechanism = request[1], request[5]
        if mechanism == b"CURVE" and len(request) > 6:
            z = self.allowed.get(request[6])
            if z is not None:
                return [b"1.0", rid, b"200", b"OK", z, b""]
            self.rejected += 1
            if self.rejected % 10_000 == 1:
                log.warning("rejected a CURVE client with an unknown public key (%d so far)",
                            self.rejected)
            return [b"1.0", rid, b"400", b"unknown key", b"", b""]
        if mechanism == b"NULL":
            return [b"1.0", rid, b"200", b"OK", b"", b""]
        return [b"1.0", rid, b"400", b"mechanism not allowed", b"", b""]
