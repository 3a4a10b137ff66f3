"""A hostile peer of a running engine: it gets past authentication (an allow-listed
CURVE key over tcp, or any process of the same user on the ipc socket) and then
misbehaves.  For the hostile-peer tests and ``python -m engine_side.bench.hostile``.

::

    python -m engine_side.bench.hostile_peer --connect tcp://127.0.0.1:PORT \\
        --server-key engine.key --secret-key hostile.key_secret --mode mix --seconds 20

Modes:

* ``mix``: rounds of every attack on the core path -- values nested past the recursion
  limit, multi-frame and garbage replies, step results naming honest, unknown and
  negative ranks with forged rows and tokens (for the step being answered, learnt from
  the engine's own stream), check-ins and Goodbyes forged for honest ranks, snapshot
  requests as other ranks, replays of everything it sent before;
* ``flood``: snapshot requests as fast as it can send them, naming ``--rank``;
* ``handshakes`` (tcp): CURVE handshakes with keys the engine does not know, over and
  over, ``--sockets`` at a time.

It prints one JSON line of counts at the end.  Never aimed anywhere but a local engine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from protocol import codec
from protocol.endpoints import channel_endpoints
from protocol.errors import ProtocolError
from protocol.messages import CheckIn, Delta, Goodbye, Heartbeat, Hello, SnapshotRequest
from protocol.replies import StepResult, encode_reply, pack_tokens

MODES = ("mix", "flood", "handshakes")
DEEP = 1000  # nested this deep, msgspec used to raise RecursionError skipping the field
_STOP = threading.Event()  # SIGTERM: stop and print the counts


def nested_tail(frame: bytes, depth: int = DEEP) -> bytes:
    """``frame`` (a msgpack fixarray, as every reply is) with one more element nested
    ``depth`` arrays deep: a valid message with an extra trailing field."""
    head = frame[0]
    assert head & 0xF0 == 0x90 and head != 0x9F, "a fixarray of up to 14 elements"
    return bytes([head + 1]) + frame[1:] + b"\x91" * depth + b"\xc0"


class Peer:
    """The attacker's sockets: SUB to learn the stream's epoch and seq, a DEALER to speak."""

    def __init__(self, endpoint: str, server_key: Path | None, secret_key: Path | None,
                 identity: bytes | None = None) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.keys: tuple[bytes, bytes, bytes] | None = None
        if server_key is not None and secret_key is not None:
            server, _ = zmq.auth.load_certificate(str(server_key))
            public, secret = zmq.auth.load_certificate(str(secret_key))
            assert secret is not None
            self.keys = (server, public, secret)
        pub, self.ctl = channel_endpoints(endpoint)
        self.sub = self._socket(zmq.SUB)
        self.sub.subscribe(b"")
        self.sub.connect(pub)
        self.dealer = self._socket(zmq.DEALER)
        if identity is not None:
            self.dealer.identity = identity
        self.dealer.connect(self.ctl)
        self.epoch, self.seq = 0, -1
        self.sent = 0
        self.blocked = 0
        self.history: list[bytes] = []

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if self.keys is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = self.keys
        return sock

    def listen(self, timeout_ms: int = 0) -> None:
        """Read the stream: the newest epoch and seq (Heartbeats and Deltas on PUB)."""
        while self.sub.poll(timeout_ms):
            timeout_ms = 0
            frames = self.sub.recv_multipart()
            if not frames[0]:
                continue  # a doorbell
            try:
                msg = codec.decode(frames)
            except ProtocolError:
                continue
            if isinstance(msg, Heartbeat | Delta):
                if msg.epoch != self.epoch:
                    self.epoch, self.seq = msg.epoch, msg.seq
                self.seq = max(self.seq, msg.seq)

    def send(self, *frames: bytes, keep: bool = True) -> bool:
        try:
            self.dealer.send_multipart(list(frames), zmq.NOBLOCK)
        except zmq.Again:
            self.blocked += 1
            return False
        self.sent += 1
        if keep and len(frames) == 1 and len(self.history) < 4096:
            self.history.append(frames[0])
        return True

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)
        self.ctx.term()


def attacks(epoch: int, seq: int, ranks: list[int], vocab: int, pid: int) -> list[list[bytes]]:
    """One round of malicious messages for the step ``seq`` of ``epoch``."""
    out: list[list[bytes]] = []
    for rank in ranks:
        result = encode_reply(StepResult(epoch, seq, rank=rank, rows=pack_tokens([0]),
                                         tokens=pack_tokens([vocab - 1])))
        out += [
            [result],  # a plausible answer for someone else's rank
            [encode_reply(StepResult(epoch, seq, rank=rank, rows=pack_tokens([0, 0, 9999]),
                                     tokens=pack_tokens([-1, vocab, 1 << 30])))],
            [encode_reply(StepResult(epoch, seq, rank=rank, rows=b"\x01\x02\x03",
                                     tokens=b"\x00" * 5))],  # not int32
            [encode_reply(StepResult(epoch, seq + 5, rank=rank))],  # a step not yet published
            [nested_tail(result)],
            [result, result],  # two frames
            [encode_reply(CheckIn(epoch, seq, rank=rank, state="synced", pid=pid + 1 + rank))],
            [encode_reply(SnapshotRequest(epoch, -1, rank=rank))],
            [nested_tail(encode_reply(SnapshotRequest(epoch, -1, rank=rank)), 5000)],
        ]
    out += [[encode_reply(Goodbye(epoch, seq, reason="hostile"))],
            [encode_reply(Hello(epoch, seq, role="worker", rank=0))],
            [b"\xff" * 17], [b""], [os.urandom(64)]]
    return out


def run_mix(peer: Peer, seconds: float, ranks: list[int], vocab: int) -> dict[str, Any]:
    deadline, rounds, replays = time.monotonic() + seconds, 0, 0
    while time.monotonic() < deadline and not _STOP.is_set():
        peer.listen(20)
        for frames in attacks(peer.epoch, peer.seq, ranks, vocab, os.getpid()):
            peer.send(*frames)
        if peer.history and rounds % 3 == 2:  # replay what it said before
            for frame in peer.history[::7][:64]:
                peer.send(frame, keep=False)
                replays += 1
        rounds += 1
    return {"rounds": rounds, "replays": replays}


def run_flood(peer: Peer, seconds: float, rank: int) -> dict[str, Any]:
    frame = encode_reply(SnapshotRequest(0, -1, rank=rank))
    deadline = time.monotonic() + seconds
    poller = zmq.Poller()
    poller.register(peer.dealer, zmq.POLLOUT)
    while time.monotonic() < deadline and not _STOP.is_set():
        if not peer.send(frame, keep=False):
            poller.poll(10)  # at the high-water mark: wait for room
    return {}


def run_handshakes(endpoint: str, server_key: Path, seconds: float, sockets: int
                   ) -> dict[str, Any]:
    """Connect with unknown keys over and over (each needs a CURVE handshake + ZAP)."""
    server, _ = zmq.auth.load_certificate(str(server_key))
    ctl = channel_endpoints(endpoint)[1]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    deadline, made = time.monotonic() + seconds, 0
    keys = [zmq.curve_keypair() for _ in range(8)]
    try:
        while time.monotonic() < deadline and not _STOP.is_set():
            batch = []
            for i in range(sockets):
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.curve_serverkey = server
                sock.curve_publickey, sock.curve_secretkey = keys[(made + i) % len(keys)]
                sock.connect(ctl)
                batch.append(sock)
            time.sleep(0.02)  # long enough for the handshakes to be tried
            for sock in batch:
                sock.close(linger=0)
            made += sockets
    finally:
        ctx.term()
    return {"handshakes": made}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hostile_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="the engine's endpoint")
    parser.add_argument("--server-key", type=Path, help="the engine's public key (tcp)")
    parser.add_argument("--secret-key", type=Path, help="an allow-listed .key_secret (tcp)")
    parser.add_argument("--mode", choices=MODES, default="mix")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 1, -5, 7],
                        help="mix: the ranks it pretends to be")
    parser.add_argument("--rank", type=int, default=0, help="flood: the rank it names")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--sockets", type=int, default=32, help="handshakes: at a time")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: _STOP.set())
    started = time.monotonic()
    if args.mode == "handshakes":
        if args.server_key is None:
            parser.error("--mode handshakes needs --server-key (a tcp endpoint)")
        out = run_handshakes(args.connect, args.server_key, args.seconds, args.sockets)
    else:
        identity = b"%d-%d" % (args.rank, os.getpid()) if args.mode == "flood" else None
        peer = Peer(args.connect, args.server_key, args.secret_key, identity)
        try:
            if args.mode == "mix":
                out = run_mix(peer, args.seconds, args.ranks, args.vocab)
            else:
                out = run_flood(peer, args.seconds, args.rank)
            out.update(sent=peer.sent, blocked=peer.blocked, epoch_seen=peer.epoch != 0)
        finally:
            peer.close()
    out.update(mode=args.mode, seconds=round(time.monotonic() - started, 2),
               cpu_s=round(time.process_time(), 3))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
