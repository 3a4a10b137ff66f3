"""A rank that loses or receives a damaged call gets it again, in order (SPEC §16).

Real sockets and a real step ring: the executor's end (its ROUTER, the ring writer and
:class:`engine_side.vllm.resend.Retransmitter`) runs in a thread, answering requests
for calls again and pinging while the rank owes an answer, as the executor does; the
rank's end is :class:`worker_side.vllm.channel.RankChannel` with faults injected
through its environment hook.  The rank must hand out every call exactly once, in
order, intact -- or, for a call no longer kept, the executor must say which rank
cannot recover.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_side.ring import RingWriter
from engine_side.vllm.resend import CallLog, Retransmitter
from protocol import calls as wire
from protocol.faults import PeerFaults
from worker_side.vllm.channel import INJECT_ENV, RankChannel

pytestmark = pytest.mark.timeout(120)


class Engine:
    """The executor's side of one rank, in its own thread (zmq sockets are not shared
    between threads): sends the calls it is given, serves ``N``, pings while owed."""

    def __init__(self, directory: Path, ring: bool, keep: int = 64) -> None:
        self.directory = directory
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.endpoint = f"ipc://{directory}/ctl"
        self.router.bind(self.endpoint)
        self.ring = RingWriter(directory, 1 << 16, 1 << 16) if ring else None
        self.stats: Counter[str] = Counter()
        self.resender = Retransmitter(self._to_rank, self.stats,
                                      PeerFaults(logging.getLogger("test"), "test"))
        self.resender.sent = CallLog(calls=keep)
        self.failure: str | None = None
        self.answered = 0  # calls the rank answered
        self.answers = 0  # in how many messages
        self.sent = 0
        self._outbox: queue.Queue[tuple[bytes, list[bytes]]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _to_rank(self, rank: int, frames: list[Any]) -> None:
        self.router.send_multipart([b"%d" % rank, *frames], copy=False)

    @property
    def ring_dir(self) -> str | None:
        return str(self.directory) if self.ring is not None else None

    def connect(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, b"0")
        sock.connect(self.endpoint)
        sock.send_multipart([wire.READY])  # lets the ROUTER route to it
        assert self.router.poll(5000) and self.router.recv_multipart()[1] == wire.READY
        self._thread.start()
        return sock

    def send(self, kind: bytes, frames: list[bytes]) -> None:
        self._outbox.put((kind, frames))

    def _send(self, kind: bytes, frames: list[bytes]) -> None:
        self.sent += 1
        call = [wire.call_head(kind, self.sent, frames), *frames]
        self.resender.record(self.sent, call)
        if self.ring is None or not self.ring.publish(call, self.sent):
            self.router.send_multipart([b"0", *call])

    def _serve(self) -> None:
        while not self._stop.is_set():
            while not self._outbox.empty():
                self._send(*self._outbox.get())
            if self.router.poll(20, zmq.POLLIN):
                _, kind, *rest = self.router.recv_multipart()
                if kind == wire.RESEND:
                    self.failure = self.resender.resend(0, rest) or self.failure
                elif kind in (wire.DONE, wire.CONTROL):
                    self.answers += 1
                    self.answered += wire.done_count([kind, *rest]) or 0 \
                        if kind == wire.DONE else 1
            elif self.answered < self.sent:
                self.resender.ping([0])

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.router.close(linger=0)
        if self.ring is not None:
            self.ring.close()


@pytest.fixture(params=[True, False], ids=["ring", "sockets"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    tmp_path.chmod(0o700)
    e = Engine(tmp_path, ring=request.param)
    yield e
    e.close()


def _calls(n: int) -> list[tuple[bytes, list[bytes]]]:
    kinds = [wire.EXECUTE, wire.SAMPLE, wire.CONTROL]
    return [(kinds[i % 3], [b"call %d" % i, bytes(range(i % 50))]) for i in range(1, n + 1)]


def _run(engine: Engine, monkeypatch: pytest.MonkeyPatch, faults: str,
         calls: list[tuple[bytes, list[bytes]]]) -> tuple[list[tuple[bytes, list[bytes]]], int]:
    """Send ``calls`` one at a time (each answered before the next, as a synchronous
    executor does) to a rank whose channel injects ``faults``."""
    monkeypatch.setenv(INJECT_ENV, faults)
    sock = engine.connect()
    channel = RankChannel(sock, engine.ring_dir, 0)
    got = []
    try:
        for kind, frames in calls:
            engine.send(kind, frames)
            got.append(channel.next_call())
            sock.send_multipart([wire.DONE])
    finally:
        channel.close()
        sock.close(linger=0)
    return got, channel.recovered


@pytest.mark.parametrize("faults", ["", "drop:0:1", "drop:0:5", "corrupt:0:5",
                                    "drop:0:3,corrupt:0:4,drop:0:9", "drop:0:12"])
def test_lost_and_damaged_calls_come_again_in_order(engine: Engine, faults: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _calls(12)
    got, recovered = _run(engine, monkeypatch, faults, calls)
    assert got == calls
    expected = len([f for f in faults.split(",") if f])
    assert recovered >= expected and engine.stats["resent_calls"] >= expected
    assert engine.failure is None


def test_calls_sent_ahead_wait_for_the_lost_one(engine: Engine,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Several calls in flight (async scheduling): a later one arrives first and waits."""
    monkeypatch.setenv(INJECT_ENV, "drop:0:2,corrupt:0:5")
    sock = engine.connect()
    channel = RankChannel(sock, engine.ring_dir, 0)
    calls = _calls(8)
    for kind, frames in calls:
        engine.send(kind, frames)
    got = [channel.next_call() for _ in calls]
    channel.close()
    sock.close(linger=0)
    assert got == calls


def test_a_call_no_longer_kept_fails_naming_the_rank(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_path.chmod(0o700)
    engine = Engine(tmp_path, ring=False, keep=2)
    monkeypatch.setenv(INJECT_ENV, "drop:0:1")
    sock = engine.connect()
    channel = RankChannel(sock, None, 0)
    for kind, frames in _calls(4):
        engine.send(kind, frames)  # call 1 is gone from the buffer of 2 by now
    waiter = threading.Thread(target=channel.next_call, daemon=True)
    waiter.start()
    deadline = time.monotonic() + 30
    while engine.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.close()  # (the rank stays blocked asking: a daemon thread, its socket open)
    assert engine.failure is not None and "rank 0 lacks call 1" in engine.failure


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["drop", "corrupt"]), st.integers(1, 10)),
                max_size=4, unique_by=lambda f: f[1]))
def test_any_faults_leave_the_calls_exact(tmp_path_factory: pytest.TempPathFactory,
                                          faults: list[tuple[str, int]]) -> None:
    directory = tmp_path_factory.mktemp("rec")
    directory.chmod(0o700)
    engine = Engine(directory, ring=bool(len(faults) % 2))
    with pytest.MonkeyPatch.context() as mp:
        try:
            got, _ = _run(engine, mp, ",".join(f"{w}:0:{n}" for w, n in faults), _calls(10))
        finally:
            engine.close()
    assert got == _calls(10)


def test_a_rank_not_the_output_rank_answers_step_calls_in_bulk(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its K answers to step calls go DONE_MAX at a time, and before its next other
    answer: every call up to a control call is answered when that call is."""
    monkeypatch.setenv(INJECT_ENV, "")
    sock = engine.connect()
    channel = RankChannel(sock, engine.ring_dir, 0, ring_replies=False)
    steps = 2 * wire.DONE_MAX + 22
    calls = [(wire.EXECUTE, [b"x"])] * steps + [(wire.CONTROL, [b"c"])] + [(wire.STEP, [b"t"])] * 3
    try:
        for kind, frames in calls:
            engine.send(kind, frames)
            got, _ = channel.next_call()
            assert got == kind
            channel.reply([wire.CONTROL, b"result"] if kind == wire.CONTROL else [wire.DONE],
                          may_wait=kind in wire.STEP_KINDS)
        deadline = time.monotonic() + 30
        while engine.answered < steps + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        channel.close()
        sock.close(linger=0)
    assert engine.answered == steps + 1  # the last three are held until a next answer
    assert engine.answers == 4  # K(64), K(64), K(22), the control call's result


def test_a_rank_asking_in_a_loop_gets_its_calls_once_per_quiet_interval(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Each answer to ``N`` may be the last 64 calls: a rank asking again for calls just
    sent again (sooner than it would repeat an unanswered request) is dropped and
    counted, not answered; a request for calls not yet sent again, or one after the
    quiet interval, is."""
    from engine_side.vllm import resend

    sent: list[list[Any]] = []
    faults = PeerFaults(logging.getLogger("test"), "test")
    r = Retransmitter(lambda rank, frames: sent.append(frames), Counter(), faults)
    for n in range(1, 11):
        r.record(n, [wire.call_head(wire.EXECUTE, n, []), b"%d" % n])
    clock = [100.0]
    monkeypatch.setattr(resend.time, "monotonic", lambda: clock[0])
    ask = [wire.NUMBER.pack(3)]
    assert r.resend(0, ask) is None and len(sent) == 8  # calls 3..10
    for _ in range(50):  # a loop of the same request: nothing more is sent
        assert r.resend(0, ask) is None
    assert len(sent) == 8 and faults.by_peer["rank 0"] == 50
    assert r.resend(1, ask) is None and len(sent) == 16  # another rank's own request
    r.record(11, [wire.call_head(wire.EXECUTE, 11, []), b"11"])
    assert r.resend(0, [wire.NUMBER.pack(11)]) is None and len(sent) == 17  # a new call
    clock[0] += resend.RESEND_QUIET_S
    assert r.resend(0, ask) is None and len(sent) == 26  # the quiet interval passed
    assert resend.RESEND_QUIET_S < wire.ASK_AGAIN_S  # an honest rank is never dropped
