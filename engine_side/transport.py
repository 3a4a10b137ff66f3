"""Engine sockets: PUB for the step stream, ROUTER for snapshots and check-ins.

The only engine code (with :mod:`engine_side.security`) that touches zmq, and
it holds no protocol decisions.  Every socket belongs to the thread that
created the transport; the engine loop calls :meth:`recv` between steps, so
snapshot requests are answered by the thread that owns the (not thread-safe)
mirror.

Endpoints: ``None`` or ``ipc://DIR`` binds ``DIR/pub`` and ``DIR/ctl`` in a
locked private directory (:class:`PrivateDir`); ``tcp://HOST:PORT`` binds PORT
(PUB) and PORT + 1 (ROUTER), and requires CURVE keys with a ZAP allow list or
the explicit ``insecure`` flag (:func:`check_tcp_policy`).

Sending: frames from :func:`protocol.codec.encode`; a message with large
tensor frames goes out zero-copy with a ``MessageTracker``, and ``publish``
waits for it (buffer-lifetime rule of :mod:`protocol.tensors`).

Local step ring (ipc endpoints, ``ring_bytes`` > 0, the default): Deltas go
through the shared-memory ring of :mod:`worker_side.ring` instead of PUB (one
that does not fit goes on PUB behind an ON_PUB marker), and workers' step
results come back through their reply rings; everything else stays on the
sockets.  A worker blocked on SUB is woken by a doorbell: one empty frame on PUB.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import zmq

from engine_side.security import (
    CurveKeys,
    PrivateDir,
    check_tcp_policy,
    start_authenticator,
)
from protocol import codec
from protocol.errors import ProtocolError
from protocol.faults import PeerFaults
from protocol.messages import Delta, Message
from protocol.replies import AnyReply, decode_reply
from worker_side.ring import DEFAULT_RING_BYTES, MESSAGE, RING_FILE, RingWriter
from worker_side.transport import DEFAULT_MAX_MESSAGE_BYTES, channel_endpoints, spin_poll

log = logging.getLogger("deltacast.engine.transport")

ZERO_COPY_MIN = 64 << 10  # tensor frames at least this big are sent zero-copy + tracked
_BATCH = 1024


class PublishStalled(Exception):
    """A zero-copy tensor frame was still referenced by zmq after ``track_timeout``."""


class EngineTransport:
    """PUB + ROUTER of one engine incarnation.

    Args:
        endpoint: ``None`` (fresh private ipc dir), ``ipc://DIR`` or ``tcp://HOST:PORT``.
        keys: CURVE server keys and the allowed worker public keys (tcp).
        insecure: allow tcp without CURVE (logs a warning).
        sndhwm: PUB high-water mark per subscriber (messages; beyond it PUB drops).
        sndbuf: kernel send buffer per connection (bytes; -1 = OS default).
        max_message_bytes: ROUTER per-frame limit (zmq drops offending connections).
        ring_bytes: size of the local step ring (ipc only; 0 = sockets only).

    Raises EndpointError (InsecureEndpoint, EndpointInUse) before binding anything.
    """

    def __init__(self, endpoint: str | None = None, *, keys: CurveKeys | None = None,
                 insecure: bool = False, sndhwm: int = 1000, sndbuf: int = -1,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 track_timeout: float = 5.0, ring_bytes: int = DEFAULT_RING_BYTES) -> None:
        check_tcp_policy(endpoint or "", keys, insecure)
        self.private: PrivateDir | None = None
        self.ring: RingWriter | None = None
        if endpoint is None or endpoint.startswith("ipc://"):
            self.private = PrivateDir(Path(endpoint[6:]) if endpoint else None)
            endpoint = self.private.endpoint
            (self.private.path / RING_FILE).unlink(missing_ok=True)  # a dead engine's
            if ring_bytes > 0:
                self.ring = RingWriter(self.private.path, ring_bytes)
        self.endpoint = endpoint
        self.track_timeout = track_timeout
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.auth = start_authenticator(self.ctx, keys.allowed) if keys is not None else None
        pub_ep, ctl_ep = channel_endpoints(endpoint)
        try:
            self.pub = self._socket(zmq.PUB, keys)
            self.pub.sndhwm = sndhwm
            if sndbuf > 0:
                self.pub.sndbuf = sndbuf
            self.pub.bind(pub_ep)
            self.router = self._socket(zmq.ROUTER, keys)
            self.router.maxmsgsize = max_message_bytes
            self.router.bind(ctl_ep)
            self.poller = zmq.Poller()
            self.poller.register(self.router, zmq.POLLIN)
        except Exception:
            self.close()
            raise
        #: worker messages dropped because they do not decode, per DEALER identity (or
        #: "rank N" for a reply ring); each peer's first is logged
        self.faults = PeerFaults(log, "dropped a worker message that does not decode")
        self.bytes_published = 0
        self.doorbells = 0

    def _socket(self, kind: int, keys: CurveKeys | None) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if keys is not None:
            sock.curve_server = True
            sock.curve_publickey = keys.public
            sock.curve_secretkey = keys.secret
        return sock

    # -- sending -----------------------------------------------------------------------
    def publish(self, msg: Message) -> int:
        """Publish ``msg`` to every subscriber; returns its size in bytes."""
        frames = codec.encode(msg)
        ring = self.ring
        if ring is None or type(msg) is not Delta:
            self._send(self.pub, frames)
        elif not ring.publish(frames, msg.seq):
            self._send(self.pub, frames)  # too large for the ring: behind its ON_PUB marker
        elif ring.sleepers():
            self.pub.send(b"")  # the doorbell: a reader blocks on SUB
            self.doorbells += 1
        size = codec.encoded_size(frames)
        self.bytes_published += size
        return size

    def publish_frames(self, frames: list[Any]) -> None:
        """Raw frames (tests: garbage, truncated and oversized input)."""
        self.pub.send_multipart(frames)

    def send_to(self, identity: bytes, msg: Message) -> int:
        """One message to the worker DEALER ``identity`` (dropped if it is gone)."""
        frames = codec.encode(msg)
        self._send(self.router, [identity, *frames])
        return codec.encoded_size(frames)

    def _send(self, sock: zmq.Socket[bytes], frames: list[Any]) -> None:
        big = any(isinstance(f, memoryview) and f.nbytes >= ZERO_COPY_MIN for f in frames)
        if not big:
            sock.send_multipart(frames)
            return
        tracker = sock.send_multipart(frames, copy=False, track=True)
        assert tracker is not None  # track=True always returns one
        try:
            tracker.wait(self.track_timeout)
        except zmq.NotDone:
            raise PublishStalled(f"a tensor frame was still queued after {self.track_timeout}s "
                                 "(a subscriber is stalled); do not mutate its tensors") from None

    # -- receiving -----------------------------------------------------------------------
    def recv(self, timeout_ms: int, spin_s: float = 0.0) -> list[tuple[bytes, AnyReply]]:
        """Worker messages that arrived within ``timeout_ms``, with sender identities;
        ``spin_s`` as in :meth:`WorkerTransport.recv` (a bounded non-blocking spin first,
        watching the reply rings too)."""
        ring = self.ring
        if ring is None:
            if not (spin_poll(self.poller, spin_s) or self.router.poll(timeout_ms)):
                return []
            return self._drain_router()
        out = self._ring_replies(ring)
        if out:  # ROUTER messages wait for the next call (the session calls every round)
            return out
        ready = bool(spin_poll(self.poller, spin_s, ring.replies_pending))
        if not ready and not ring.replies_pending():
            # blocking: a ring reply is seen on the next call (the caller's timeout late)
            ready = bool(self.router.poll(timeout_ms))
        return self._ring_replies(ring) + (self._drain_router() if ready else [])

    @property
    def malformed(self) -> int:
        """Worker messages dropped because they do not decode (all peers)."""
        return self.faults.total

    def _drain_router(self) -> list[tuple[bytes, AnyReply]]:
        """Up to _BATCH ROUTER messages; one that does not decode is its sender's fault:
        dropped and counted (:attr:`faults`), never raised."""
        out: list[tuple[bytes, AnyReply]] = []
        for _ in range(_BATCH):
            try:
                identity, *frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                out.append((identity.bytes, decode_reply(frames)))
            except ProtocolError as exc:
                self.faults.hit(identity.bytes, exc)
        return out

    def _ring_replies(self, ring: RingWriter) -> list[tuple[bytes, AnyReply]]:
        """Replies from the reply rings (identity b"": they name their rank)."""
        out: list[tuple[bytes, AnyReply]] = []
        for rank, kind, payload in ring.replies():
            if kind != MESSAGE:  # this channel's workers send large replies on DEALER alone
                continue
            try:
                out.append((b"", decode_reply([payload])))
            except ProtocolError as exc:
                self.faults.hit(f"rank {rank} (reply ring)", exc)
        return out

    def close(self) -> None:
        """Close sockets (linger 0), stop ZAP, remove the ring and the ipc directory."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for name in ("pub", "router"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.ctx.term()
        if self.private is not None:
            self.private.close()
            self.private = None
