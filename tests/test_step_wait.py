"""How engine and workers wait for steps: the join handshake and the bounded spin.

Pure tests drive an :class:`EngineSession` over a scripted in-memory transport;
the idle-CPU test runs a real worker process and reads its CPU clock.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from engine_side.liveness import LivenessView, WorkerJoined
from engine_side.mirror import EngineMirror
from engine_side.session import EngineSession
from protocol.messages import TOKEN_MODE_ENGINE, CheckIn, Message, SnapshotRequest
from protocol.replies import AnyReply


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
