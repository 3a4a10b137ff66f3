"""Who may speak for which rank (engine_side.peers) and what the session does with a
peer's messages: bindings, one live session per rank, results checked against their
step, rate limits and mutes, liveness while the ROUTER is backlogged.  Pure: a scripted
transport that vouches for principals, and a fake clock."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from engine_side.liveness import LivenessView
from engine_side.mirror import EngineMirror
from engine_side.peers import (
    RANK_TAKEN,
    RATE_LIMITED,
    SECOND_SESSION,
    UNKNOWN_RANK,
    WRONG_RANK,
    PeerBook,
    declared_pid,
)
from engine_side.results import SampledTokens, sampling_rows
from engine_side.scheduler import Scheduler
from engine_side.session import BadResult, EngineSession
from protocol.messages import TOKEN_MODE_ENGINE, CheckIn, Goodbye, Message, SnapshotRequest
from protocol.replies import AnyReply, StepResult, pack_tokens

KEY_A, KEY_B, HOSTILE = b"key:A", b"key:B", b"key:H"


class Transport:
    """Stands in for EngineTransport: scripted (identity, principal, message) batches."""

    def __init__(self) -> None:
        self.batches: deque[list[tuple[bytes, bytes | None, AnyReply]]] = deque()
        self.sent: list[tuple[bytes | None, Message]] = []
        self.muted: dict[bytes, float] = {}
        self.backlog = False
        self.ring = None

    def publish(self, msg: Message) -> int:
        self.sent.append((None, msg))
        return 16

    def send_to(self, identity: bytes, msg: Message) -> int:
        self.sent.append((identity, msg))
        return 16

    def recv_from(self, timeout_ms: int, *args: Any) -> list[tuple[bytes, bytes | None,
                                                                   AnyReply]]:
        return self.batches.popleft() if self.batches else []

    def mute(self, peer: bytes, seconds: float) -> None:
        self.muted[peer] = seconds

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _session(peers: PeerBook | None = None, **kw: Any
             ) -> tuple[EngineSession, Transport, Clock]:
    transport, clock = Transport(), Clock()
    session = EngineSession(transport, EngineMirror(token_mode=TOKEN_MODE_ENGINE),  # type: ignore[arg-type]
                            LivenessView(dead_after=1.0), clock=clock, peers=peers,
                            heartbeat_interval=1e9, **kw)
    return session, transport, clock


def _feed(session: EngineSession, transport: Transport,
          *batch: tuple[bytes, bytes | None, AnyReply]) -> None:
    transport.batches.append(list(batch))
    session.service(0.0)


def _join(session: EngineSession, transport: Transport, principal: bytes, rank: int,
          pid: int) -> None:
    route = b"%d-%d" % (rank, pid)
    _feed(session, transport, (b"c%d" % pid, principal, CheckIn(0, -1, rank=rank, pid=pid,
                                                                  state="awaiting_snapshot")),
          (route, principal, SnapshotRequest(0, -1, rank=rank)))


# -- the book alone -----------------------------------------------------------------------
def test_a_key_is_bound_to_its_first_rank_and_a_rank_to_its_first_key() -> None:
    book = PeerBook(range(4))
    assert book.claim(KEY_A, 1, 10, None) is None
    assert book.claim(KEY_A, 2, 10, None) == WRONG_RANK  # A speaks for 1 only
    assert book.claim(KEY_B, 1, 11, None) == RANK_TAKEN  # 1 is A's, even with no session
    assert book.claim(KEY_B, 9, 11, None) == UNKNOWN_RANK
    assert book.claim(KEY_B, -5, 11, None) == UNKNOWN_RANK
    assert book.claim(KEY_B, 2, 11, None) is None
    assert book.rank_of(KEY_A) == 1 and book.rank_of(KEY_B) == 2


def test_one_live_session_per_key_the_first_stays_until_it_is_dead() -> None:
    book = PeerBook()
    assert book.claim(KEY_A, 0, 10, None) is None
    assert book.claim(KEY_A, 0, 11, 10) == SECOND_SESSION  # 10 is alive
    assert book.claim(KEY_A, 0, None, 10) is None  # a message that names no process
    assert book.claim(KEY_A, 0, 11, None) is None  # 10 is dead: 11 takes over


def test_a_process_rank_passes_on_only_when_its_session_is_dead() -> None:
    book = PeerBook(range(2))
    assert book.claim(b"pid:10", 0, 10, None) is None
    assert book.claim(b"pid:11", 0, 11, 10) == RANK_TAKEN
    assert book.claim(b"pid:11", 0, 11, None) is None  # 10 died: a restart takes it
    assert book.claim(b"pid:10", 0, 10, None) is None  # and back (none is alive)
    assert book.claim(b"pid:10", 1, 10, None) == WRONG_RANK


def test_a_spawned_process_is_expected_and_nobody_else_may_speak_for_its_rank() -> None:
    book = PeerBook(range(2))
    assert book.claim(b"pid:66", 0, 66, None) is None  # an intruder came first
    book.expect(0, 10)
    assert book.claim(b"pid:66", 0, 66, None) == RANK_TAKEN
    assert book.claim(b"pid:10", 0, 10, None) is None
    book.follow({0: type("P", (), {"pid": 12})()})  # restarted by its supervisor
    assert book.claim(b"pid:10", 0, 10, None) == RANK_TAKEN
    assert book.claim(b"pid:12", 0, 12, None) is None


def test_a_pinned_key_speaks_for_its_ranks_and_no_other_key_does() -> None:
    book = PeerBook(range(3), pinned={KEY_A: {0, 1}})
    assert book.claim(KEY_A, 0, 10, None) is None and book.claim(KEY_A, 1, 11, None) is None
    assert book.claim(KEY_A, 2, 12, None) == WRONG_RANK
    assert book.claim(HOSTILE, 0, 13, None) == RANK_TAKEN  # before A ever spoke, too
    assert book.claim(b"ring:1", 1, None, 11) is None
    assert book.claim(b"ring:1", 0, None, 10) == WRONG_RANK


def test_rates_snapshot_budget_refills_and_faults_mute() -> None:
    book = PeerBook(snapshot_rate=2.0, snapshot_burst=3, fault_rate=1.0, fault_burst=5)
    assert [book.allow_snapshot(KEY_A, 0.0) for _ in range(4)] == [True] * 3 + [False]
    assert book.allow_snapshot(KEY_A, 0.5)  # one more after half a second
    assert not book.allow_snapshot(KEY_A, 0.5)
    assert [book.refuse(HOSTILE, RATE_LIMITED, 0.0) for _ in range(6)] == [False] * 5 + [True]
    assert book.refused[RATE_LIMITED] == 6 and book.mutes == 1
    assert book.faults.by_peer[HOSTILE] == 6


def test_declared_pid_reads_a_core_workers_route() -> None:
    assert declared_pid(b"3-4567") == 4567 and declared_pid(b"-5-1") == 1
    assert declared_pid(b"\x00k\x8b") is None and declared_pid(b"3-") is None


# -- the session ---------------------------------------------------------------------------
def _stepped(peers: PeerBook | None = None) -> tuple[EngineSession, Transport, Clock, Any]:
    """A session with ranks 0 (key A) and 1 (key B) joined and one step published."""
    session, transport, clock = _session(peers, ranks=range(2), validate=SampledTokens(512))
    _join(session, transport, KEY_A, 0, 10)
    _join(session, transport, KEY_B, 1, 11)
    scheduler = Scheduler(num_blocks=64, token_budget=64, max_running=8)
    scheduler.add("r0", np.arange(5), 3)
    scheduler.add("r1", np.arange(100), 3)
    request = scheduler.schedule()
    session.publish_step(request)
    return session, transport, clock, request


def _result(session: EngineSession, rank: int, rows: list[int], tokens: list[int],
            seq: int | None = None) -> StepResult:
    return StepResult(session.mirror.epoch, session._pending if seq is None else seq,
                      rank=rank, rows=pack_tokens(rows), tokens=pack_tokens(tokens))


def test_a_result_naming_another_rank_is_dropped_and_counted_never_used() -> None:
    session, transport, _, request = _stepped()
    rows = sampling_rows(request).tolist()
    forged = _result(session, 0, rows, [7] * len(rows))
    _feed(session, transport, (b"1-11", KEY_B, forged))  # B answers as rank 0
    _feed(session, transport, (b"x", HOSTILE, _result(session, -5, rows, [1] * len(rows))))
    assert session.answers == {}
    assert session.peers.refused[WRONG_RANK] == 1 and session.peers.refused[UNKNOWN_RANK] == 1
    good = [_result(session, r, rows, [5] * len(rows)) for r in (0, 1)]
    _feed(session, transport, (b"0-10", KEY_A, good[0]), (b"1-11", KEY_B, good[1]))
    assert session.wait_step(session._pending) == good[0]
    assert session.divergent == []


def test_forged_rows_and_tokens_are_that_ranks_fault_not_an_exception() -> None:
    session, transport, _, request = _stepped()
    rows = sampling_rows(request).tolist()
    assert rows == [0]  # r1's 100-token prompt is chunked: only r0 samples this step
    for bad in (_result(session, 1, [0, 1], [5, 5]),  # a row that does not sample
                _result(session, 1, [9999], [5]),  # a row past the batch
                _result(session, 1, rows, [512]),  # outside the vocabulary
                _result(session, 1, rows, [-1]),
                _result(session, 1, rows, [])):
        _feed(session, transport, (b"1-11", KEY_B, bad))
    odd = StepResult(session.mirror.epoch, session._pending, rank=1, rows=b"\x01\x02\x03")
    _feed(session, transport, (b"1-11", KEY_B, odd))
    assert session.stats["bad_results"] == 6
    assert {type(d) for d in session.divergent} == {BadResult}
    assert {d.rank for d in session.divergent} == {1}
    assert 1 not in session.wait_set(session._pending)  # not waited for: no hang
    _feed(session, transport, (b"0-10", KEY_A, _result(session, 0, rows, [3])))
    assert session.wait_step(session._pending) is not None


def test_a_result_for_a_step_not_yet_published_is_refused() -> None:
    session, transport, _, _ = _stepped()
    _feed(session, transport, (b"1-11", KEY_B, _result(session, 1, [0], [1],
                                                       seq=session._pending + 5)))
    assert session.stats["refused"] == 1 and session.answers == {}


def test_a_second_process_with_a_key_in_use_is_refused_until_the_first_is_dead() -> None:
    session, transport, clock = _session(ranks=range(1))
    _join(session, transport, KEY_A, 0, 10)
    _feed(session, transport, (b"c20", KEY_A, CheckIn(0, -1, rank=0, pid=20, state="x")),
          (b"0-20", KEY_A, SnapshotRequest(0, -1, rank=0)),
          (b"0-20", KEY_A, Goodbye(0, 0)))
    assert session.liveness.workers[0].pid == 10 and 0 not in session.goodbyes
    assert session.peers.refused[SECOND_SESSION] == 3
    clock.now = 2.0  # pid 10 falls silent past the bound: dead
    _feed(session, transport)
    assert not session.liveness.workers[0].alive
    _feed(session, transport, (b"c20", KEY_A, CheckIn(0, -1, rank=0, pid=20, state="x")))
    assert session.liveness.workers[0].pid == 20 and session.liveness.workers[0].alive


def test_a_goodbye_counts_only_from_the_ranks_live_session() -> None:
    session, transport, _ = _session(ranks=range(2))
    _feed(session, transport, (b"h", b"pid:66", CheckIn(0, -1, rank=0, pid=66, state="x")))
    session.peers.expect(0, 10)  # the supervisor spawned pid 10 for rank 0
    _join(session, transport, b"pid:10", 0, 10)
    _feed(session, transport, (b"h", b"pid:66", Goodbye(0, 0)))
    assert 0 not in session.goodbyes and session.liveness.workers[0].alive
    _feed(session, transport, (b"0-10", b"pid:10", Goodbye(0, 0)))
    assert session.goodbyes == {0}


def test_a_check_in_naming_another_process_is_refused() -> None:
    session, transport, _ = _session()
    _feed(session, transport, (b"h", b"pid:66", CheckIn(0, -1, rank=0, pid=10, state="x")))
    assert session.liveness.workers == {} and session.peers.refused[SECOND_SESSION] == 1


def test_snapshot_requests_are_rate_limited_and_a_flooder_is_muted() -> None:
    book = PeerBook(range(2), snapshot_burst=2, snapshot_rate=1.0, fault_burst=10)
    session, transport, _ = _session(book)
    for _ in range(5):
        _feed(session, transport, (b"0-10", KEY_A, SnapshotRequest(0, -1, rank=0)))
    assert session.stats["snapshots"] == 2 and book.refused[RATE_LIMITED] == 3
    for _ in range(20):
        _feed(session, transport, (b"h", HOSTILE, SnapshotRequest(0, -1, rank=0)))
    assert transport.muted == {HOSTILE: book.mute_s}
    assert session.stats["snapshots"] == 2


def test_silence_is_not_judged_while_the_router_is_backlogged() -> None:
    session, transport, clock = _session()
    _join(session, transport, KEY_A, 0, 10)
    transport.backlog = True  # a flood queued ahead of the check-ins
    clock.now = 1.5
    _feed(session, transport)
    assert session.liveness.workers[0].alive  # not judged yet
    _feed(session, transport, (b"c10", KEY_A, CheckIn(0, 0, rank=0, pid=10, state="synced")))
    transport.backlog = False
    _feed(session, transport)
    assert session.liveness.workers[0].alive
    clock.now = 5.0
    transport.backlog = True  # backlogged for longer than the bound: judged after all
    _feed(session, transport)
    clock.now = 6.5
    _feed(session, transport)
    assert not session.liveness.workers[0].alive
