"""How engine and workers wait for steps: the join handshake and the bounded spin.

Pure tests drive an :class:`EngineSession` over a scripted in-memory transport;
the idle-CPU test runs a real worker process and reads its CPU clock.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from engine_side.bench.latency import cpu_seconds
from engine_side.liveness import LivenessView, WorkerJoined
from engine_side.mirror import EngineMirror
from engine_side.session import EngineSession
from engine_side.transport import EngineTransport
from engine_side.workloads import Workload
from protocol.messages import TOKEN_MODE_ENGINE, CheckIn, Message, SnapshotRequest
from protocol.replies import AnyReply

REPO = Path(__file__).resolve().parent.parent


class ScriptedTransport:
    """Stands in for EngineTransport: ``recv`` hands out one scripted batch per call."""

    def __init__(self, batches: list[list[tuple[bytes, AnyReply]]]) -> None:
        self.batches = deque(batches)
        self.sent: list[tuple[bytes | None, Message]] = []

    def publish(self, msg: Message) -> int:
        self.sent.append((None, msg))
        return 16

    def send_to(self, identity: bytes, msg: Message) -> int:
        self.sent.append((identity, msg))
        return 16

    def recv(self, timeout_ms: int, *args: Any) -> list[tuple[bytes, AnyReply]]:
        return self.batches.popleft() if self.batches else []


def _session(transport: ScriptedTransport) -> EngineSession:
    return EngineSession(transport, EngineMirror(token_mode=TOKEN_MODE_ENGINE),  # type: ignore[arg-type]
                         LivenessView(dead_after=60.0))


def test_first_check_in_after_the_snapshot_keeps_the_worker_joined() -> None:
    """Check-ins travel on their own socket, so a worker's first one may arrive after its
    snapshot was served; that must not undo the join (it used to: wait_for_workers hung)."""
    transport = ScriptedTransport([
        [(b"w0", SnapshotRequest(epoch=0, seq=-1, rank=0))],
        [(b"c0", CheckIn(epoch=0, seq=0, rank=0, state="synced", pid=100))],
    ])
    session = _session(transport)
    session.service(0.0)
    session.service(0.0)
    assert session.joined_at == {0: 1}
    session.wait_for_workers(1, timeout=0.0)  # returns at once: rank 0 has joined


def test_a_new_incarnation_replacing_a_live_one_drops_the_stale_join() -> None:
    view = LivenessView(dead_after=60.0)
    view.check_in(0, 100, 3, "synced", now=0.0)
    assert view.check_in(0, 101, -1, "awaiting_snapshot", now=1.0) == [WorkerJoined(0, 101, 100)]
    transport = ScriptedTransport([
        [(b"c0", CheckIn(epoch=0, seq=-1, rank=0, state="synced", pid=100))],
        [(b"w0", SnapshotRequest(epoch=0, seq=-1, rank=0))],
        [(b"c1", CheckIn(epoch=0, seq=-1, rank=0, state="awaiting_snapshot", pid=101))],
    ])
    session = _session(transport)
    for _ in range(3):
        session.service(0.0)
    assert session.joined_at == {}  # the join belonged to pid 100, which pid 101 replaced


def _service_for(session: EngineSession, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        session.service(0.02)


@pytest.mark.integration
def test_idle_worker_blocks_after_its_spin_window(tmp_path: Path) -> None:
    """Steps start a worker's bounded spin; heartbeats (the engine idling) must not: once
    the window has passed, an idle worker sleeps in poll and uses next to no CPU."""
    workload = Workload("steady_decode", 8, seed=0)
    session = EngineSession(EngineTransport(None), EngineMirror(token_mode=workload.token_mode),
                            LivenessView(dead_after=5.0), ack_spin=0.0)
    log = (tmp_path / "w0.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "worker_side.main", "--ack-only", "--connect",
                             session.transport.endpoint, "--spin-ms", "200",
                             "--engine-timeout", "20"], cwd=REPO, stdin=subprocess.DEVNULL,
                            stderr=log)
    try:
        session.wait_for_workers(1, timeout=60)
        for req in [*workload.warmup(), *(workload.step() for _ in range(20))]:
            session.run_step(req)
        _service_for(session, 0.5)  # the 200 ms spin window runs out; heartbeats continue
        cpu0 = cpu_seconds(proc.pid)
        _service_for(session, 1.0)
        idle_cpu = cpu_seconds(proc.pid) - cpu0
        assert session.stats["heartbeats"] > 10
        assert idle_cpu < 0.1, f"idle worker used {idle_cpu:.2f} CPU s in 1 s: still spinning"
    finally:
        session.close(expect={0})
        proc.wait(20)
        log.close()


def test_spin_poll_wakes_on_a_message_or_elsewhere_and_gives_up_at_its_deadline() -> None:
    import zmq

    from worker_side.transport import spin_poll

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    poller = zmq.Poller()
    poller.register(b, zmq.POLLIN)
    try:
        a.bind("inproc://spin")
        b.connect("inproc://spin")
        assert spin_poll(poller, 0.01) == []  # nothing sent: the spin ends
        assert spin_poll(poller, 5.0, lambda: True) == []  # elsewhere ready: ends at once
        a.send(b"x")
        assert spin_poll(poller, 5.0) == [(b, zmq.POLLIN)]
        assert spin_poll(poller, 5.0, lambda: False) == [(b, zmq.POLLIN)]  # sockets polled too
        assert b.recv() == b"x"
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
