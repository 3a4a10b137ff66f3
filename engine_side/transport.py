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

Receiving: :meth:`EngineTransport.recv_from` hands out each worker message with the
*principal* vouched for (the CURVE key the ZAP handler admitted; on ipc the connecting
process, from ``SO_PEERCRED``, a process of another user refused outright; a reply ring's
rank); :mod:`engine_side.peers` decides what it may say.  A message that does not decode
is its sender's fault (counted per connection, reported to ``on_fault``).  A muted
peer's frames are dropped undecoded, at most :data:`MUTED_RATE` a second: past that the
ROUTER is left unread for a millisecond, so the flood backs up into its sender.

Local step ring (ipc endpoints, ``ring_bytes`` > 0, the default): Deltas go
through the shared-memory ring (:mod:`engine_side.ring`) instead of PUB (one
that does not fit goes on PUB behind an ON_PUB marker), and workers' step
results come back through their reply rings; everything else stays on the
sockets.  A worker blocked on SUB is woken by a doorbell: one empty frame on PUB.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import zmq

from engine_side.peers import Bucket, curve_principal
from engine_side.ring import RingWriter
from engine_side.security import (
    CurveKeys,
    PrivateDir,
    check_tcp_policy,
)
from engine_side.zap import ZapHandler
from protocol import codec
from protocol.endpoints import DEFAULT_MAX_MESSAGE_BYTES, channel_endpoints
from protocol.errors import MalformedMessage, ProtocolError
from protocol.faults import PeerFaults
from protocol.messages import Delta, Message
from protocol.replies import AnyReply, decode_reply
from protocol.ring import DEFAULT_RING_BYTES, MESSAGE, RING_FILE
from protocol.spin import spin

log = logging.getLogger("deltacast.engine.transport")

ZERO_COPY_MIN = 64 << 10  # tensor frames at least this big are sent zero-copy + tracked
_BATCH = 1024
_MAX_MUTED = 4096  # muted peers remembered at most (expired ones go first)
#: frames of muted peers dropped per second at most; past it the ROUTER is not read for
#: _PAUSE_S, so a flood backs up into its sender's socket (honest messages are at most a
#: few frames behind in zmq's fair queue: they wait one pause at most)
MUTED_RATE = 10_000.0
_PAUSE_S = 0.001


#: ``spin_poll(poller, spin_s, elsewhere=None)``: :func:`protocol.spin.spin` on our clock
spin_poll = partial(spin, clock=time.perf_counter, pause=os.sched_yield)


class Inbound(NamedTuple):
    """One worker message: the ROUTER identity of its connection (b"" for a reply ring),
    the principal vouched for (:meth:`EngineTransport.recv_from`) and the message."""

    identity: bytes
    principal: bytes | None
    msg: AnyReply


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
                 track_timeout: float = 5.0, ring_bytes: int = DEFAULT_RING_BYTES,
                 muted_rate: float = MUTED_RATE) -> None:
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
        self.auth = ZapHandler(self.ctx, keys.allowed) if keys is not None else None
        #: principals pinned to ranks (:class:`CurveKeys` ``pinned``), for the session
        self.pinned: dict[bytes, frozenset[int]] = {
            curve_principal(k): frozenset(r) for k, r in (keys.pinned if keys else {}).items()}
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
        #: whether the last drain stopped at its batch limit (more messages were waiting)
        self.backlog = False
        self.muted_drops = 0  # frames of muted peers dropped undecoded
        self.pauses = 0  # reads of the ROUTER paused because muted peers used their budget
        self._muted: dict[bytes, float] = {}
        self._muted_budget = Bucket(muted_rate, max(1.0, muted_rate * _PAUSE_S), 0.0, 0.0)
        self._paused_until = 0.0
        #: called with (principal or identity, error) for each message that does not decode
        self.on_fault: Callable[[bytes, ProtocolError], None] | None = None
        self._uid = os.getuid()

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
        return [(identity, msg) for identity, _, msg in self.recv_from(timeout_ms, spin_s)]

    def recv_from(self, timeout_ms: int, spin_s: float = 0.0) -> list[Inbound]:
        """:meth:`recv` with the principal each message came from (:mod:`engine_side.peers`:
        ``key:`` + its CURVE key, ``pid:`` + the ipc peer's pid, ``ring:`` + the rank of a
        reply ring; None when nobody vouches for it, tcp without CURVE)."""
        pause = self._paused_until - time.monotonic()
        if pause > 0:  # muted peers' frames used the read budget: let them wait in zmq
            time.sleep(min(pause, timeout_ms / 1e3))
        ring = self.ring
        if ring is None:
            if not (spin_poll(self.poller, spin_s) or self.router.poll(timeout_ms)):
                self.backlog = False
                return []
            return self._drain_router()
        out = self._ring_replies(ring)
        if out:  # ROUTER messages wait for the next call (the session calls every round)
            return out
        ready = bool(spin_poll(self.poller, spin_s, ring.replies_pending))
        if not ready and not ring.replies_pending():
            # blocking: a ring reply is seen on the next call (the caller's timeout late)
            ready = bool(self.router.poll(timeout_ms))
        self.backlog = False
        return self._ring_replies(ring) + (self._drain_router() if ready else [])

    @property
    def malformed(self) -> int:
        """Worker messages dropped because they do not decode (all peers)."""
        return self.faults.total

    def mute(self, peer: bytes, seconds: float) -> None:
        """Drop ``peer``'s frames (a principal, or an identity when it has none) without
        decoding them for ``seconds`` (:class:`engine_side.peers.PeerBook` decides)."""
        if len(self._muted) >= _MAX_MUTED:
            now = time.monotonic()
            self._muted = {p: t for p, t in self._muted.items() if t > now}
        self._muted[peer] = time.monotonic() + seconds

    def _principal(self, frame: zmq.Frame) -> bytes | None:
        if self.auth is not None:  # CURVE: the key the ZAP handler admitted
            return curve_principal(str(frame.get("User-Id")))
        if self.private is None:
            return None  # tcp --insecure: nobody vouches for the sender
        # ipc: "ADDR:UID:GID:PID" from SO_PEERCRED, filled in by the kernel
        _, uid, _, pid = str(frame.get("Peer-Address")).rsplit(":", 3)
        return b"pid:" + pid.encode() if int(uid) == self._uid else b"uid:" + uid.encode()

    def _drain_router(self) -> list[Inbound]:
        """Up to _BATCH ROUTER messages; one that does not decode is its sender's fault:
        dropped and counted (:attr:`faults`), never raised.  A muted sender's frames are
        dropped undecoded (:attr:`muted_drops`); :attr:`backlog` says whether more wait."""
        out: list[Inbound] = []
        muted, now = self._muted, time.monotonic()
        for _ in range(_BATCH):
            try:
                identity, *frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.backlog = False
                break
            try:
                principal = self._principal(frames[0]) if frames else None
            except (zmq.ZMQError, ValueError):
                principal = None
            sender = identity.bytes
            if muted and muted.get(principal or sender, 0.0) > now:
                self.muted_drops += 1
                if not self._muted_budget.take(now):  # read no more for a while: the
                    self._paused_until = now + _PAUSE_S  # flood backs up into its sender
                    self.pauses += 1
                    self.backlog = True
                    break
                continue
            if principal is not None and principal.startswith(b"uid:"):
                self._fault(sender, principal, MalformedMessage("a process of another user"))
                continue
            try:
                out.append(Inbound(sender, principal, decode_reply(frames)))
            except ProtocolError as exc:
                self._fault(sender, principal, exc)
        else:
            self.backlog = True
        return out

    def _ring_replies(self, ring: RingWriter) -> list[Inbound]:
        """Replies from the reply rings (identity b"": they name their rank)."""
        out: list[Inbound] = []
        for rank, kind, payload in ring.replies():
            if kind != MESSAGE:  # this channel's workers send large replies on DEALER alone
                continue
            try:
                out.append(Inbound(b"", b"ring:%d" % rank, decode_reply([payload])))
            except ProtocolError as exc:
                self._fault(f"rank {rank} (reply ring)", b"ring:%d" % rank, exc)
        return out

    def _fault(self, sender: Hashable, principal: bytes | None, exc: ProtocolError) -> None:
        """A message that does not decode: counted per connection (:attr:`faults`) and
        reported to :attr:`on_fault` with its principal (or identity)."""
        self.faults.hit(sender, exc)
        if self.on_fault is not None:
            self.on_fault(principal if principal is not None else sender, exc)  # type: ignore[arg-type]

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
            self.auth.stop()  # (kept: its count of refused handshakes stays readable)
        self.ctx.term()
        if self.private is not None:
            self.private.close()
            self.private = None
