"""A node's relay between the engine's ROUTER and the node's ranks (SPEC §16.1), with
real sockets: the engine's end is :class:`RemoteRanks` over CURVE on tcp, the ranks
are DEALERs on the relay's ipc endpoint (no vLLM needed; end to end:
tests/test_vllm_nodes.py)."""

from __future__ import annotations

import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from hypothesis import given
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from engine_side.keys import write_keys
from engine_side.vllm.nodes import NodeLayout
from engine_side.vllm.rank_deaths import LINK_EVENTS
from engine_side.vllm.remote import RemoteRanks
from protocol import calls as wire
from protocol.errors import LocalProtocolError, MalformedMessage
from protocol.ring import RING_FILE
from worker_side.vllm.channel import RankChannel
from worker_side.vllm.relay import Relay

WORLD = 4  # ranks 0, 1 here; 2, 3 on node 1


_FRAMES = st.lists(st.binary(max_size=300) | st.builds(lambda n, b: b * n, st.integers(
    0, 9000), st.binary(min_size=1, max_size=3)), min_size=2, max_size=64)


@given(_FRAMES)
def test_relayed_frames_round_trip(frames: list[bytes]) -> None:
    """Exact, deflated or not; large frames that deflate well cross smaller."""
    payload = wire.pack_relayed(frames)
    assert [bytes(f) for f in wire.unpack_relayed(payload)] == frames
    size = sum(map(len, frames))
    if wire.RELAY_DEFLATE_MIN <= size <= wire.RELAY_DEFLATE_MAX and len(set(b"".join(
            frames))) == 1:
        assert len(payload) < size // 2


@given(st.binary(max_size=200) | _FRAMES.map(wire.pack_relayed).flatmap(
    lambda p: st.sampled_from([p[:k] + b"\x00" + p[k + 1:] for k in range(0, len(p), 97)])))
def test_any_bytes_are_relayed_frames_or_malformed(payload: bytes) -> None:
    try:
        frames = wire.unpack_relayed(payload)
    except MalformedMessage:
        return
    assert 2 <= len(frames) <= wire.RELAY_FRAMES
    assert [bytes(f) for f in wire.unpack_relayed(wire.pack_relayed(frames))] == \
        [bytes(f) for f in frames]


def test_a_relayed_message_is_a_target_and_at_least_one_frame() -> None:
    for frames in ([], [b"*"]):
        with pytest.raises(LocalProtocolError, match="a target and its frames"):
            wire.pack_relayed(frames)
        with pytest.raises(MalformedMessage, match="frame count"):
            wire.unpack_relayed(struct.pack(f"<H{len(frames)}I", len(frames),
                                             *map(len, frames)) + b"".join(frames))


def test_a_deflated_message_that_claims_more_or_less_than_it_inflates_to_is_malformed() -> None:
    big = [b"*", b"x" * (1 << 16)]
    payload = wire.pack_relayed(big)
    count, size = struct.unpack_from("<HI", payload)
    assert count & 0x8000 and size == 4 * 2 + 1 + (1 << 16)
    for claim in (size - 1, size + 1, wire.RELAY_DEFLATE_MAX + 1024):
        with pytest.raises(MalformedMessage):
            wire.unpack_relayed(payload[:2] + struct.pack("<I", claim) + payload[6:])
    bomb = zlib.compress(struct.pack("<2I", 1, 1 << 30) + bytes(1 << 24), 9)  # 16 MiB of 0
    with pytest.raises(MalformedMessage):
        wire.unpack_relayed(struct.pack("<HI", 0x8002, 8 + (1 << 30)) + bomb)
    with pytest.raises(MalformedMessage):
        wire.unpack_relayed(payload[:-4])  # cut short


def test_relay_identities_name_their_node() -> None:
    assert wire.relay_node(wire.relay_identity(3, 12)) == 3
    for other in (b"3", b"node3", b"node/1", b"nodex/1", b"node3/x", b""):
        assert wire.relay_node(other) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """The executor's ROUTER with the node layout's keys, and its monitor."""

    def __init__(self, keys: Path) -> None:
        self.layout = NodeLayout.from_config({
            "deltacast_nnodes": 2, "deltacast_master_addr": "127.0.0.1",
            "deltacast_master_port": _free_port() - 1, "deltacast_keys": str(keys)}, WORLD)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.remote = RemoteRanks(self.layout, WORLD, self.ctx, self.sock)
        self.monitor = self.sock.get_monitor_socket(LINK_EVENTS)  # as the executor's
        self.remote.bind(self.sock, None)

    def recv(self, timeout_s: float = 5.0) -> list[bytes]:
        assert self.sock.poll(int(timeout_s * 1000)), "nothing reached the engine"
        return self.remote.recv(self.sock)

    def lost(self, timeout_s: float) -> int | None:
        """The node a link event loses within ``timeout_s``, else None."""
        end = time.monotonic() + timeout_s
        while self.monitor.poll(max(1, int((end - time.monotonic()) * 1000))):
            event = recv_monitor_message(self.monitor)
            node = self.remote.link_event(event["event"], event["endpoint"].decode())
            if node is not None:
                return node
        return None

    def close(self) -> None:
        self.remote.close()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture()
def keys(tmp_path: Path) -> Path:
    write_keys(tmp_path / "keys", 1)
    return tmp_path / "keys"


@pytest.fixture()
def engine(keys: Path) -> Iterator[Engine]:
    e = Engine(keys)
    yield e
    e.close()


def _node_curve(keys: Path) -> tuple[bytes, bytes, bytes]:
    public, secret = zmq.auth.load_certificate(str(keys / "worker1.key_secret"))
    assert secret is not None
    return zmq.auth.load_certificate(str(keys / "engine.key"))[0], public, secret


def _relay(tmp_path: Path, engine: Engine, curve: tuple[bytes, bytes, bytes],
           generation: int = 1) -> Relay:
    return Relay(str(tmp_path), 1, generation, engine.layout.channel(1), curve,
                 range(2, 4), liveness_s=0.6)


def _ranks(ctx: zmq.Context[Any], relay: Relay, idents: list[bytes]) -> list[zmq.Socket[bytes]]:
    out = []
    for ident in idents:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, ident)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(relay.endpoint)
        out.append(sock)
    return out


def _got(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(5000), "nothing reached the rank"
    return sock.recv_multipart()


def _hello(rank: zmq.Socket[bytes]) -> None:
    rank.send_multipart([wire.HELLO, wire.pack_hello(node="1", vllm="v", protocol="3",
                                                     config="c")])


def test_one_copy_per_node_reaches_every_rank_and_answers_come_back(
        tmp_path: Path, keys: Path, engine: Engine) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with _relay(tmp_path, engine, _node_curve(keys)) as relay:
        two, three = _ranks(ctx, relay, [b"2", b"3"])
        for rank, ident in ((two, b"2"), (three, b"3")):
            _hello(rank)
            got = engine.recv()
            assert got[:2] == [ident, wire.HELLO] and wire.parse_hello(got[2])["node"] == "1"
        assert engine.remote.hosts[2].startswith("127.0.0.1")
        engine.remote.send(engine.sock, 3, [wire.WELCOME, b"s" * 32, b"x"])
        assert _got(three) == [wire.WELCOME, b"s" * 32, b"x"]
        body = bytes(range(256)) * 40
        call = [wire.call_head(wire.EXECUTE, 1, [body, b""]), body, b""]
        engine.remote.broadcast(engine.sock, call)
        assert _got(two) == call and _got(three) == call
        assert relay.relayed == 2  # the welcome and one copy of the call, for both ranks
        three.send_multipart([wire.OUTPUT, body, b""])
        assert engine.recv() == [b"3", wire.OUTPUT, body, b""]
        two.send_multipart([wire.DONE])
        assert engine.recv() == [b"2", wire.DONE]
        for sock in (two, three):
            sock.close(linger=0)
    ctx.term()


@pytest.mark.parametrize("count", [300, wire.RELAY_FRAMES - 2])
def test_calls_and_answers_of_many_frames_cross_the_relay(
        tmp_path: Path, keys: Path, engine: Engine, count: int) -> None:
    """A step whose joining requests carry many tensors (a frame each: 40 images of two
    tensors make 81 frames), and an answer with a tensor per request (a pooling model's
    at batch 300), cross between hosts whole, up to the most a relayed message holds."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with _relay(tmp_path, engine, _node_curve(keys)) as relay:
        (two,) = _ranks(ctx, relay, [b"2"])
        _hello(two)
        assert engine.recv()[:2] == [b"2", wire.HELLO]
        body = [b"%d" % k * (k % 7) for k in range(count)]
        call = [wire.call_head(wire.EXECUTE, 1, body), *body]
        engine.remote.broadcast(engine.sock, call)
        assert _got(two) == call
        two.send_multipart([wire.OUTPUT, *body])
        assert engine.recv() == [b"2", wire.OUTPUT, *body]
        if count == wire.RELAY_FRAMES - 2:  # the rank's identity and one more: too many
            two.send_multipart([wire.OUTPUT, *body, b"x"])
            rank, kind, text = engine.recv()
            assert (rank, kind) == (b"2", wire.ERROR) and b"too many frames" in text
            with pytest.raises(LocalProtocolError, match="too many frames"):
                engine.remote.broadcast(engine.sock, [*call, b"x"])
        two.close(linger=0)
    ctx.term()


def test_the_relay_notes_when_the_engine_restarts_the_group(
        tmp_path: Path, keys: Path, engine: Engine) -> None:
    """The node's supervision stops a rank that does not exit after the engine's restart
    (a rank hung in a step never reads it): the relay notes when it passed that on."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with _relay(tmp_path, engine, _node_curve(keys)) as relay:
        (two,) = _ranks(ctx, relay, [b"2"])
        _hello(two)
        assert engine.recv()[:2] == [b"2", wire.HELLO]
        for number, call in enumerate(([wire.RESTART], [], [wire.RESTART, b""]), 1):
            engine.remote.broadcast(engine.sock, [wire.call_head(wire.QUIT if number > 1
                                                                 else wire.EXECUTE, number,
                                                                 call), *call])
            _got(two)
        assert relay.told_restart is None  # an execute, a plain quit, a quit of two frames
        before = time.monotonic()
        engine.remote.broadcast(engine.sock, [wire.call_head(wire.QUIT, 4, [wire.RESTART]),
                                              wire.RESTART])
        assert _got(two)[1:] == [wire.RESTART]
        assert relay.told_restart is not None and relay.told_restart >= before
        two.close(linger=0)
    ctx.term()


def test_calls_reach_the_nodes_ranks_once_through_its_ring_and_replies_come_back(
        tmp_path: Path, keys: Path, engine: Engine) -> None:
    """With a ring, each call for every rank is written once into the node's step ring:
    a rank already asleep is woken by its doorbell, one reading later finds the calls in
    order, a call over half the ring comes on the ROUTER behind its marker, and
    per-rank messages and replies keep to the ROUTER."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    relay = Relay(str(tmp_path), 1, 1, engine.layout.channel(1), _node_curve(keys),
                  range(2, 4), liveness_s=0.6, ring_bytes=64 << 10)
    two, three = _ranks(ctx, relay, [b"2", b"3"])
    channels = [RankChannel(sock, str(tmp_path), rank, ring_replies=False)
                for sock, rank in ((two, 2), (three, 3))]
    got: list[tuple[bytes, list[bytes]]] = []
    try:
        _hello(two)
        assert engine.recv()[:2] == [b"2", wire.HELLO]
        asleep = threading.Thread(target=lambda: got.append(channels[1].next_call()))
        asleep.start()  # rank 3 waits for its first call (it does not spin: it sleeps)
        for _ in range(100):
            if channels[1].ring is not None and channels[1].ring.seg.sleeping_any():
                break
            time.sleep(0.01)
        calls = []
        for number, body in enumerate((b"a" * 100, bytes(range(256)) * 160, b"c"), 1):
            call = [wire.call_head(wire.EXECUTE, number, [body]), body]
            calls.append(call)
            engine.remote.broadcast(engine.sock, call)
        asleep.join(5.0)
        assert got == [(wire.EXECUTE, [calls[0][1]])]  # woken by its doorbell
        for number, call in enumerate(calls, 1):
            if number > 1:
                assert channels[1].next_call() == (wire.EXECUTE, [call[1]])
            assert channels[0].next_call() == (wire.EXECUTE, [call[1]])
        assert (relay.ring_calls, relay.socket_calls) == (2, 1)  # 40 KiB: over half the ring
        engine.remote.send(engine.sock, 3, [wire.WELCOME, b"s" * 32, b"x"])
        assert _got(three) == [wire.WELCOME, b"s" * 32, b"x"]
        channels[1].reply([wire.OUTPUT, b"out"])
        assert engine.recv() == [b"3", wire.OUTPUT, b"out"]
    finally:
        for channel in channels:
            channel.close()
        for sock in (two, three):
            sock.close(linger=0)
        relay.close()
        ctx.term()
    assert not (tmp_path / RING_FILE).exists()  # the relay removes its ring's file


def test_a_relayed_message_from_no_rank_of_the_node_is_from_no_rank(
        tmp_path: Path, keys: Path, engine: Engine) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with _relay(tmp_path, engine, _node_curve(keys)) as relay:
        local, stranger, two = _ranks(ctx, relay, [b"0", b"x", b"2"])
        for sock in (local, stranger):  # rank 0 is the engine's; "x" is nobody
            _hello(sock)
            assert wire.rank_of(engine.recv()[0], WORLD) is None
        two.send_multipart([wire.DONE])  # before any hello: no session of the node yet
        assert wire.rank_of(engine.recv()[0], WORLD) is None
        _hello(two)
        assert engine.recv()[0] == b"2"
        for sock in (local, stranger, two):
            sock.close(linger=0)
    ctx.term()


def test_an_old_session_of_the_node_is_heard_no_more(tmp_path: Path, keys: Path,
                                                      engine: Engine) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    old = _relay(tmp_path, engine, _node_curve(keys), generation=1)
    new = _relay(tmp_path, engine, _node_curve(keys), generation=2)
    try:
        (was,) = _ranks(ctx, old, [b"2"])
        (now,) = _ranks(ctx, new, [b"2"])
        _hello(was)
        assert engine.recv()[0] == b"2"
        _hello(now)  # the restarted generation's hello: its session is the node's now
        assert engine.recv()[0] == b"2"
        was.send_multipart([wire.DONE])
        assert wire.rank_of(engine.recv()[0], WORLD) is None
        engine.remote.send(engine.sock, 2, [wire.PING, wire.NUMBER.pack(7)])
        assert _got(now) == [wire.PING, wire.NUMBER.pack(7)]
        assert not was.poll(200)
        for sock in (was, now):
            sock.close(linger=0)
    finally:
        old.close()
        new.close()
        ctx.term()


def test_the_engine_sees_the_node_lost_when_its_relay_closes(
        tmp_path: Path, keys: Path, engine: Engine) -> None:
    relay = _relay(tmp_path, engine, _node_curve(keys))
    try:
        assert engine.lost(1.0) is None  # the handshake: joined, nothing lost
    finally:
        relay.close()
    assert engine.lost(2.0) == 1


def test_the_relay_and_its_ranks_see_the_engine_go(tmp_path: Path, keys: Path) -> None:
    engine = Engine(keys)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    relay = _relay(tmp_path, engine, _node_curve(keys))
    (rank,) = _ranks(ctx, relay, [b"2"])
    monitor = rank.get_monitor_socket()
    try:
        assert engine.lost(1.0) is None
        engine.close()
        for _ in range(40):
            if relay.failure:
                break
            time.sleep(0.05)
        assert relay.failure and relay.failure.startswith("lost the engine at tcp://127.0.0.1")
        events = []
        while monitor.poll(2000):
            events.append(recv_monitor_message(monitor)["event"])
            if zmq.EVENT_DISCONNECTED in events:
                break
        assert zmq.EVENT_DISCONNECTED in events  # the rank's link dropped: it exits
    finally:
        rank.disable_monitor()
        monitor.close(linger=0)
        rank.close(linger=0)
        relay.close()
        ctx.term()


def test_a_key_the_engine_does_not_know_is_refused_with_a_reason(
        tmp_path: Path, keys: Path, engine: Engine) -> None:
    public, secret = zmq.curve_keypair()
    with _relay(tmp_path, engine, (_node_curve(keys)[0], public, secret)) as relay:
        for _ in range(60):
            if relay.failure:
                break
            time.sleep(0.05)
        assert relay.failure and "refused this node's CURVE key" in relay.failure


def test_a_malformed_message_from_the_engine_is_dropped_and_the_next_call_relayed(
        tmp_path: Path, keys: Path, engine: Engine, capfd: pytest.CaptureFixture[str]) -> None:
    """What the relay cannot take (two frames; a relayed message of a target and nothing
    for it; not a relayed message at all) is dropped and said once each on stderr; the
    relay carries on with the engine's next call."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with _relay(tmp_path, engine, _node_curve(keys)) as relay:
        (two,) = _ranks(ctx, relay, [b"2"])
        _hello(two)
        assert engine.recv()[:2] == [b"2", wire.HELLO]
        route = engine.remote._routes[1]
        with pytest.raises(LocalProtocolError):  # the engine does not send one ...
            engine.remote.broadcast(engine.sock, [])
        for target in (wire.RELAY_ALL, b"2"):  # ... and the relay drops one: no frame
            engine.sock.send_multipart([route, struct.pack("<HI", 1, 1) + target])
        engine.sock.send_multipart([route, b"\xff\xff"])
        engine.sock.send_multipart([route, wire.pack_relayed([b"2", b"x"]), b"y"])
        call = [wire.call_head(wire.EXECUTE, 1, [b"body"]), b"body"]
        engine.remote.broadcast(engine.sock, call)
        assert _got(two) == call
        assert not two.poll(100)  # nothing else reached the rank
        assert relay.relayed == 1 and relay.failure is None  # the call alone
        two.close(linger=0)
    ctx.term()
    err = capfd.readouterr().err
    assert err.count("dropped a malformed message from the engine") == 4, err


def test_a_fault_of_the_relay_itself_fails_it_and_drops_its_ranks_links(
        tmp_path: Path, keys: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the relay's thread (here: reading a message raises) must not leave its
    ranks waiting on a relay that relays nothing: the relay fails with the error, and
    each rank's link drops (so it exits, and the node with it)."""
    import worker_side.vllm.relay as relay_module

    def broken(payload: Any) -> list[memoryview]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(relay_module, "unpack_relayed", broken)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with _relay(tmp_path, engine, _node_curve(keys)) as relay:
        (two,) = _ranks(ctx, relay, [b"2"])
        monitor = two.get_monitor_socket()
        try:
            _hello(two)
            assert engine.recv()[:2] == [b"2", wire.HELLO]
            engine.remote.broadcast(engine.sock, [wire.call_head(wire.EXECUTE, 1, []), b""])
            events = []
            while monitor.poll(2000):
                events.append(recv_monitor_message(monitor)["event"])
                if zmq.EVENT_DISCONNECTED in events:
                    break
            assert zmq.EVENT_DISCONNECTED in events
            assert relay.failure == "stopped by an internal error (RuntimeError: a bug)"
        finally:
            two.disable_monitor()
            monitor.close(linger=0)
            two.close(linger=0)
    ctx.term()
