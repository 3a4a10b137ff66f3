"""Worker sockets: SUB for the engine's stream, DEALERs for requests and check-ins.

The only worker code that touches zmq.  It holds no protocol decisions: frames
are decoded and handed to the caller, which feeds the pure WorkerReplica.

* ``SUB`` connects to the engine's PUB and subscribes to everything.  The first
  message that arrives proves the subscription is live (:attr:`heard`); only
  then should a snapshot be requested (Clone ordering: subscribe, then ask).
* ``DEALER`` (main thread) carries snapshot requests, step results and Goodbye
  to the engine's ROUTER, and receives snapshots.
* :class:`CheckInThread` owns a second DEALER: check-ins keep flowing while the
  main thread computes.  No socket is ever used from two threads.

* An ``ipc://DIR`` endpoint is used only when DIR is private (ours, 0700, not a
  symlink: :mod:`protocol.ipc_dir`), checked before connecting: a worker never
  sends its check-ins into another user's directory (EndpointError otherwise).
* With ``rank`` and an ipc endpoint whose engine serves a local step ring
  (:mod:`worker_side.ring`), Deltas arrive through the ring and step results
  leave through this rank's reply ring.  :meth:`recv` merges the ring with SUB
  (a Delta too large for the ring comes on PUB behind an ON_PUB marker: the
  ring's later records wait for it), and re-attaches when another engine takes
  the directory over.  A doorbell (one empty frame on SUB) only wakes us.

Bad input never changes state: frames that fail to decode, or whose total size
exceeds ``max_message_bytes``, are counted and logged once.  zmq enforces
``MAXMSGSIZE`` per frame by dropping the connection; a socket monitor reports
each drop (it reconnects by itself; the replica sees the gap and resyncs).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from protocol import codec
from protocol.endpoints import DEFAULT_MAX_MESSAGE_BYTES, channel_endpoints, ipc_directory
from protocol.errors import MalformedMessage
from protocol.ipc_dir import check_private_dir
from protocol.messages import AnyMessage, CheckIn, Delta
from protocol.replies import AnyReply, StepResult, encode_reply
from protocol.ring import MESSAGE, ON_PUB, RING_FILE, unpack_frames
from protocol.spin import spin
from worker_side.ring import RingError, RingReader

log = logging.getLogger("deltacast.worker.transport")

_BATCH = 256  # messages drained per socket per recv() call
_MONITORED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
AWAIT_PUB_S = 1.0  # how long ring records wait for a Delta announced ON_PUB (then: a gap)
_RING_CHECK_S = 0.1  # at most this often: is there a (new) ring to attach?


#: ``spin_poll(poller, spin_s, elsewhere=None)``: :func:`protocol.spin.spin` on our clock
spin_poll = partial(spin, clock=time.perf_counter, pause=os.sched_yield)


def checked_endpoints(endpoint: str) -> tuple[str, str]:
    """:func:`protocol.endpoints.channel_endpoints`, after checking that an ipc DIR is
    private (EndpointError: :mod:`protocol.ipc_dir`): a worker checks before it connects."""
    directory = ipc_directory(endpoint)
    if directory is not None:
        check_private_dir(Path(directory))
    return channel_endpoints(endpoint)


@dataclass(frozen=True)
class _Await:
    """A ring position whose Delta went on PUB."""

    seq: int
    since: float


@dataclass(frozen=True)
class ClientKeys:
    """CURVE keys of a worker (z85): the engine's public key and our own pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @staticmethod
    def from_files(server_key: Path, secret_key: Path) -> ClientKeys:
        """Keys from zmq certificate files: the engine's public one and our secret one."""
        server, _ = zmq.auth.load_certificate(str(server_key))
        public, secret = zmq.auth.load_certificate(str(secret_key))
        if secret is None:
            raise ValueError(f"{secret_key} holds no secret key (pass the .key_secret file)")
        return ClientKeys(server, public, secret)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class _Once:
    """Count an anomaly; log only its first occurrence."""

    def __init__(self, what: str) -> None:
        self.what, self.count = what, 0

    def hit(self, detail: object) -> None:
        self.count += 1
        if self.count == 1:
            log.warning("%s: %s (further ones are only counted)", self.what, detail)


class WorkerTransport:
    """The main thread's sockets (SUB + DEALER), created and used on that thread."""

    def __init__(self, endpoint: str, keys: ClientKeys | None = None, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, rcvhwm: int = 1000,
                 rcvbuf: int = -1, identity: bytes | None = None,
                 rank: int | None = None) -> None:
        pub_ep, self.ctl_endpoint = checked_endpoints(endpoint)  # (first)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.endpoint, self.keys = endpoint, keys
        self.max_message_bytes = max_message_bytes
        self.sub = self._socket(zmq.SUB, rcvhwm=rcvhwm, rcvbuf=rcvbuf)
        self.sub.maxmsgsize = max_message_bytes
        self.sub.subscribe(b"")
        self.dealer = self._socket(zmq.DEALER, identity=identity)
        self.dealer.maxmsgsize = max_message_bytes
        self.endpoints = {self.sub: pub_ep, self.dealer: self.ctl_endpoint}
        self.monitors = {sock.get_monitor_socket(_MONITORED): sock for sock in self.endpoints}
        for sock, ep in self.endpoints.items():
            sock.connect(ep)
        self.poller = zmq.Poller()
        for sock in (self.sub, self.dealer, *self.monitors):
            self.poller.register(sock, zmq.POLLIN)
        self.heard = False
        self.malformed = _Once("dropped frames that do not decode")
        self.oversized = _Once("dropped a message over max_message_bytes")
        self.dropped = _Once("connection to the engine dropped (a frame over the size limit, "
                             "or the engine went away); zmq reconnects")
        self.auth_failed = _Once("the engine rejected our CURVE key")
        self.ring_lost = _Once("a Delta announced on PUB never came (the replica resyncs)")
        self.rank = rank
        self.ring: RingReader | None = None
        self.ring_dir = Path(endpoint[6:]) if endpoint.startswith("ipc://") else None
        self._ring_checked = float("-inf")
        self._queue: list[AnyMessage | _Await] = []  # ring order, SUB extras behind
        self._from_pub: dict[int, Delta] = {}
        self._check_ring(force=True)

    def _socket(self, kind: int, *, rcvhwm: int = 1000, rcvbuf: int = -1,
                identity: bytes | None = None) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.rcvhwm = rcvhwm
        if rcvbuf > 0:
            sock.rcvbuf = rcvbuf
        if identity is not None:
            sock.identity = identity
        if self.keys is not None:
            self.keys.apply(sock)
        return sock

    def recv(self, timeout_ms: int, spin_s: float = 0.0) -> list[AnyMessage]:
        """Messages that arrived within ``timeout_ms`` (the stream first, then DEALER).

        ``spin_s`` > 0: first poll without blocking for up to that long, yielding the
        CPU between polls (no wake-up latency), then block for ``timeout_ms``."""
        ready = dict(self._wait(timeout_ms, spin_s))
        for monitor, sock in self.monitors.items():
            if monitor in ready:
                self._drain_monitor(monitor, sock)
        sub = self._drain(self.sub) if self.sub in ready else []
        self.heard = self.heard or bool(sub)  # the subscription is live (Clone ordering)
        out = self._stream(sub) if self.ring is not None or self._queue else sub
        if self.dealer in ready:
            out += self._drain(self.dealer)
        return out

    def _wait(self, timeout_ms: int, spin_s: float) -> list[tuple[Any, int]]:
        ring = self.ring
        if ring is None:
            return spin_poll(self.poller, spin_s) or self.poller.poll(timeout_ms)
        if ring.pending():
            return self.poller.poll(0)
        ready = spin_poll(self.poller, spin_s, ring.pending)
        if ready or ring.pending():
            return ready
        # announce that we block; records that came meanwhile mean: do not block
        ready = self.poller.poll(0 if ring.sleep(True) else timeout_ms)
        ring.sleep(False)
        return ready

    # -- the local ring ---------------------------------------------------------------
    def _check_ring(self, force: bool = False) -> None:
        """Attach the directory's ring if there is one, re-attach if it changed."""
        now = time.monotonic()
        if self.ring_dir is None or (not force and now - self._ring_checked < _RING_CHECK_S):
            return
        self._ring_checked = now
        if self.ring is not None and not self.ring.stale():
            return
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if not (self.ring_dir / RING_FILE).exists():
            return
        if self.rank is None:
            raise RingError(f"{self.ring_dir} serves a local step ring: pass this worker's rank "
                            "(or start the engine without a ring, ring_bytes=0)")
        try:
            self.ring = RingReader(self.ring_dir, self.rank)
        except RingError as exc:  # the engine sends Deltas only there: we cannot follow it
            raise RingError(f"{exc}; start the engine without a ring (ring_bytes=0)") from exc

    def _stream(self, sub: list[AnyMessage]) -> list[AnyMessage]:
        """The ring's records, then SUB's messages, in stream order (see the module doc)."""
        if sub:
            self._check_ring()  # may re-attach: read self.ring only after it
        ring, now = self.ring, time.monotonic()
        if ring is not None:
            for kind, payload in ring.read():
                if kind == ON_PUB:
                    self._queue.append(_Await(int.from_bytes(payload[:8], "little"), now))
                elif kind == MESSAGE:
                    self._queue += self._decode_record(payload)
        for msg in sub:
            if type(msg) is Delta:
                self._from_pub[msg.seq] = msg
            else:
                self._queue.append(msg)
        return self._release(now)

    def _decode_record(self, payload: bytes) -> list[AnyMessage]:
        try:
            return [codec.decode(unpack_frames(payload))]
        except MalformedMessage as exc:
            self.malformed.hit(exc)
            return []

    def _release(self, now: float) -> list[AnyMessage]:
        """The queue's front up to the first ON_PUB Delta that has not come yet."""
        out: list[AnyMessage] = []
        queue, taken = self._queue, 0
        for item in queue:
            if isinstance(item, _Await):
                msg = self._from_pub.pop(item.seq, None)
                if msg is None and now - item.since < AWAIT_PUB_S:
                    break
                if msg is None:
                    self.ring_lost.hit(f"seq {item.seq}")
                else:
                    out.append(msg)
            else:
                out.append(item)
            taken += 1
        del queue[:taken]
        if len(self._from_pub) > 64:  # never awaited (a stale engine's): keep it bounded
            for seq in sorted(self._from_pub)[:-64]:
                del self._from_pub[seq]
        return out

    def _drain(self, sock: zmq.Socket[bytes]) -> list[AnyMessage]:
        out: list[AnyMessage] = []
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) == 1 and not len(frames[0].buffer):
                continue  # a doorbell: it only woke us
            if sum(len(f.buffer) for f in frames) > self.max_message_bytes:
                self.oversized.hit(f"{len(frames)} frames")
                continue
            try:
                out.append(codec.decode(frames))
            except MalformedMessage as exc:
                self.malformed.hit(exc)
        return out

    def _drain_monitor(self, monitor: zmq.Socket[bytes], sock: zmq.Socket[bytes]) -> None:
        while monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.dropped.hit("peer disconnected")
                self._reconnect(sock)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.auth_failed.hit("ZAP denied")

    def _reconnect(self, sock: zmq.Socket[bytes]) -> None:
        """zmq does not reconnect after a protocol error (e.g. MAXMSGSIZE): do it here."""
        endpoint = self.endpoints[sock]
        with contextlib.suppress(zmq.ZMQError):
            sock.disconnect(endpoint)
        sock.connect(endpoint)

    def send(self, msg: AnyReply) -> None:
        """One reply to the engine (never blocks: dropped if the engine is gone); a step
        result goes through the reply ring when there is one and it fits."""
        data = encode_reply(msg)
        if self.ring is not None and type(msg) is StepResult and self.ring.reply(data):
            return
        try:
            self.dealer.send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.debug("engine not reachable; %s dropped", type(msg).__name__)

    def stats(self) -> dict[str, int]:
        return {"malformed": self.malformed.count, "oversized": self.oversized.count,
                "disconnects": self.dropped.count, "auth_failures": self.auth_failed.count,
                "ring": int(self.ring is not None), "ring_lost": self.ring_lost.count,
                "ring_overruns": self.ring.overruns if self.ring is not None else 0}

    def close(self, goodbye_linger_ms: int = 100) -> None:
        """Close everything; the DEALER lingers briefly so a final Goodbye gets out."""
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for monitor, sock in self.monitors.items():
            sock.disable_monitor()
            monitor.close(linger=0)
        self.sub.close(linger=0)
        self.dealer.close(linger=goodbye_linger_ms)
        self.ctx.term()


class CheckInThread(threading.Thread):
    """Sends ``status()`` as a CheckIn every ``interval`` seconds on its own DEALER."""

    def __init__(self, endpoint: str, status: Callable[[], CheckIn], interval: float = 0.05,
                 keys: ClientKeys | None = None) -> None:
        super().__init__(name="deltacast-checkin", daemon=True)
        self.ctl_endpoint = checked_endpoints(endpoint)[1]
        self.status, self.interval, self.keys = status, interval, keys
        self._stop_event = threading.Event()

    def run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 4  # stale check-ins are worthless: drop rather than queue
        if self.keys is not None:
            self.keys.apply(sock)
        sock.connect(self.ctl_endpoint)
        try:
            while not self._stop_event.is_set():
                with contextlib.suppress(zmq.Again):  # engine away: this check-in is moot
                    sock.send(encode_reply(self.status()), zmq.NOBLOCK)
                self._stop_event.wait(self.interval)
        finally:
            sock.close(linger=0)
            ctx.term()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2.0)
