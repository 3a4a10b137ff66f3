"""The worker's transition table, exhaustively (h2 style): every (State, Input) pair.

For each pair the replica is put into that state by a realistic history (a
snapshot loaded → SYNCED, a replica started with ``start=`` → SYNCED at seq 0, a gap
→ DESYNCED, a Goodbye → CLOSED, a fresh or closed-then-restarted worker →
AWAITING_SNAPSHOT) and fed a real message that classifies as that input.  The
resulting state must be the table's target; for a pair missing from ``TRANSITIONS``
the replica raises RemoteProtocolError and changes nothing.  Whenever the replica
ends SYNCED its digest must equal the engine's at its (epoch, seq).  A DESYNCED
replica recovers by a snapshot or by the deltas it missed, retransmitted: an
in-order delta applies, then the buffered deltas that continue it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest
from oracle import Oracle, replica_request, state_fingerprint

from engine_side.mirror import EngineMirror
from protocol.errors import IncompatibleVersion, RemoteProtocolError
from protocol.messages import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    AnyMessage,
    CheckIn,
    Delta,
    Goodbye,
    Heartbeat,
    Hello,
    Snapshot,
    SnapshotRequest,
)
from protocol.params import SamplingSpec
from protocol.rebuild import decode_extension
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, requests_equal
from protocol.state import ReplicaState
from worker_side import events as ev
from worker_side.replica import TRANSITIONS, Action, Input, State, WorkerReplica

# ---------------------------------------------------------------- a small engine


@functools.cache
def _spec(k: int) -> RequestSpec:
    prompt = np.arange(k, k + 4, dtype=np.int64)
    prompt.flags.writeable = False
    return RequestSpec(f"r{k}", prompt, SamplingSpec(seed=k))


def _request(t: int) -> ExecuteModelRequest:
    """Step ``t``: requests r(t-2)..r(t) decode, r(t-3) finishes."""
    live = list(range(max(0, t - 2), t + 1))
    n = len(live)
    return ExecuteModelRequest(
        req_ids=[f"r{k}" for k in live], specs=[_spec(k) for k in live],
        num_scheduled_tokens=np.ones(n, dtype=np.int64),
        num_computed_tokens=np.array([4 + t - k for k in live], dtype=np.int64),
        block_tables=(Ragged.from_lists([[k, 100 + k] for k in live]),),
        spec_token_ids=Ragged.empty(n), encoder_inputs=Ragged.empty(n),
        finished_req_ids=frozenset({f"r{t - 3}"} if t >= 3 else set()),
    )


@dataclass
class Engine:
    """An engine incarnation that keeps every delta, snapshot and digest it produced."""

    epoch: int
    oracle: Oracle = field(init=False)
    deltas: dict[int, Delta] = field(default_factory=dict)
    requests: dict[int, ExecuteModelRequest] = field(default_factory=dict)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    heartbeats: dict[int, Heartbeat] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.oracle = Oracle(epoch=self.epoch)

    @property
    def mirror(self) -> EngineMirror:
        return self.oracle.mirror

    def step(self) -> Delta:
        request = _request(self.mirror.seq + 1)
        delta = self.oracle.diff(request)
        self.deltas[delta.seq], self.requests[delta.seq] = delta, request
        self.snapshots[delta.seq] = self.mirror.snapshot()
        self.heartbeats[delta.seq] = self.heartbeat()
        return delta

    def upto(self, seq: int) -> None:
        while self.mirror.seq < seq:
            self.step()

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(*self.mirror.heartbeat_fields())


@dataclass
class World:
    engine: Engine
    restarted: Engine  # the same engine after a restart: a new epoch
    replica: WorkerReplica

    def digest_at(self, epoch: int, seq: int) -> int:
        engine = self.engine if epoch == self.engine.epoch else self.restarted
        return 0 if seq == 0 else engine.snapshots[seq].digest


def _world() -> World:
    engine, restarted = Engine(1), Engine(2)
    engine.upto(2)
    restarted.upto(1)
    return World(engine, restarted, WorkerReplica())


def _feed(world: World, msg: AnyMessage, now: float = 0.0) -> list[ev.Event]:
    return world.replica.receive(msg, now)


# ---------------------------------------------------------------- situations per state


def fresh() -> World:
    """A worker that just joined: no snapshot yet."""
    return _world()


def synced() -> World:
    """Snapshot 2 loaded, then delta 3 applied."""
    w = _world()
    _feed(w, w.engine.snapshots[2])
    _feed(w, w.engine.step())
    assert w.replica.state is State.SYNCED and w.replica.seq == 3
    return w


def started() -> World:
    """A replica that exists from the epoch's start (``start=``): SYNCED at seq 0."""
    w = _world()
    w.replica = WorkerReplica(start=(1, ReplicaState()))
    assert w.replica.state is State.SYNCED and (w.replica.epoch, w.replica.seq) == (1, 0)
    return w


def desynced() -> World:
    """Synced at 3, then a heartbeat says 4 was published: delta 4 was lost."""
    w = synced()
    w.engine.upto(4)
    assert isinstance(_feed(w, w.engine.heartbeat())[0], ev.GapDetected)
    assert w.replica.state is State.DESYNCED and w.replica.seq == 3
    return w


def rejected() -> World:
    """Synced at 3, then delta 4 arrived with a digest that does not match."""
    w = synced()
    d4 = w.engine.step()
    assert isinstance(_feed(w, Delta(d4.epoch, d4.seq, d4.digest ^ 1, d4.body))[0],
                      ev.RejectedDelta)
    assert w.replica.state is State.DESYNCED and w.replica.seq == 3
    return w


def holding() -> World:
    """Synced at 3, then delta 5 arrived while 4 is still missing (a gap): DESYNCED at
    3, holding 5 (not in the table's situations: a stale snapshot then leaves a gap)."""
    w = synced()
    w.engine.upto(5)
    assert isinstance(_feed(w, w.engine.deltas[5])[0], ev.GapDetected)
    assert w.replica.state is State.DESYNCED and w.replica.seq == 3
    return w


def closed() -> World:
    """Synced at 3, then the engine said Goodbye."""
    w = synced()
    _feed(w, Goodbye(epoch=1, seq=3, reason="shutdown"))
    assert w.replica.state is State.CLOSED
    return w


def reopened() -> World:
    """Closed, then the restarted engine's first delta: waiting for its snapshot."""
    w = closed()
    _feed(w, w.restarted.deltas[1])
    assert w.replica.state is State.AWAITING_SNAPSHOT
    return w


SITUATIONS: dict[State, list[Callable[[], World]]] = {
    State.AWAITING_SNAPSHOT: [fresh, reopened],
    State.SYNCED: [synced, started],
    State.DESYNCED: [desynced, rejected],
    State.CLOSED: [closed],
}

# ---------------------------------------------------------------- messages per input

Make = Callable[[World], AnyMessage | None]


def _delta(w: World, seq: int) -> Delta | None:
    if seq < 1:
        return None
    w.engine.upto(seq)
    return w.engine.deltas[seq]


def _fresh_snapshot(w: World) -> Snapshot:
    w.engine.upto(w.replica.seq + 1)
    return w.engine.snapshots[w.engine.mirror.seq]


def _ahead(w: World) -> Heartbeat:
    w.engine.upto(w.replica.seq + 1)
    return w.engine.heartbeat()


MESSAGES: dict[Input, list[Make]] = {
    Input.DELTA_IN_ORDER: [lambda w: _delta(w, w.replica.seq + 1)],
    Input.DELTA_STALE: [lambda w: _delta(w, w.replica.seq - 1), lambda w: _delta(w, w.replica.seq)],
    Input.DELTA_GAP: [lambda w: _delta(w, w.replica.seq + 2)],
    Input.NEW_EPOCH: [lambda w: w.restarted.deltas[1], lambda w: w.restarted.heartbeat(),
                      lambda w: Goodbye(epoch=2, seq=1, reason="restart")],
    Input.SNAPSHOT: [_fresh_snapshot, lambda w: w.restarted.snapshots[1]],
    Input.SNAPSHOT_STALE: [lambda w: w.engine.snapshots.get(w.replica.seq)],
    Input.HEARTBEAT: [lambda w: w.engine.heartbeat(),  # or an old one, arriving late:
                      lambda w: w.engine.heartbeats.get(w.replica.seq)],
    Input.HEARTBEAT_AHEAD: [_ahead],
    Input.HELLO: [lambda w: Hello(epoch=w.engine.epoch, seq=0, minor=PROTOCOL_MINOR + 1)],
    Input.GOODBYE: [lambda w: Goodbye(epoch=1, seq=w.engine.mirror.seq, reason="bye")],
}

EXPECTED_EVENTS: dict[Action, tuple[type[ev.Event], ...]] = {
    Action.APPLY: (ev.Applied,),
    Action.DISCARD: (ev.Discarded,),
    Action.BUFFER: (ev.Buffered,),
    Action.DESYNC: (ev.GapDetected, ev.EpochChanged),
    Action.LOAD: (ev.SnapshotLoaded,),
    Action.CLOSE: (ev.Closed,),
}


def _cases(state: State, kind: Input) -> list[tuple[str, World, AnyMessage]]:
    """Every (situation, message) combination that realises (state, kind)."""
    out = []
    for situation in SITUATIONS[state]:
        for make in MESSAGES[kind]:
            world = situation()
            msg = make(world)
            if msg is not None and world.replica.classify(msg) is kind:
                out.append((situation.__name__, world, msg))
    return out


def _observable(replica: WorkerReplica) -> tuple[object, ...]:
    data = replica.data
    return replica.state, replica.epoch, replica.seq, None if data is None else data.digest


@pytest.mark.parametrize("kind", list(Input))
@pytest.mark.parametrize("state", list(State))
def test_transition(state: State, kind: Input) -> None:
    cases = _cases(state, kind)
    assert cases, f"no realistic situation gives {state} x {kind}"
    entry = TRANSITIONS.get((state, kind))
    for name, world, msg in cases:
        replica = world.replica
        if entry is None:
            before = _observable(replica)
            with pytest.raises(RemoteProtocolError):
                replica.receive(msg, 1.0)
            assert _observable(replica) == before, name
            continue
        action, target = entry
        events = replica.receive(msg, 1.0)
        assert replica.state is target, (name, msg, events)
        quiet = action is Action.BUFFER and not isinstance(msg, Delta)  # nothing to keep
        if action in EXPECTED_EVENTS and not quiet:
            assert events and isinstance(events[0], EXPECTED_EVENTS[action]), (name, events)
        if replica.state is State.SYNCED:
            assert replica.data is not None
            assert replica.data.digest == world.digest_at(replica.epoch, replica.seq)
            assert replica.data.digest == replica.data.recompute_digest()
            if events and isinstance(events[-1], ev.Applied):  # the step a receiver builds
                engine = world.engine if replica.epoch == 1 else world.restarted
                assert requests_equal(replica_request(replica), engine.requests[replica.seq])


def test_missing_pairs_are_exactly_the_documented_ones() -> None:
    missing = {(s, i) for s in State for i in Input} - set(TRANSITIONS)
    assert missing == {(State.CLOSED, Input.DELTA_IN_ORDER), (State.CLOSED, Input.DELTA_GAP),
                       (State.CLOSED, Input.SNAPSHOT_STALE),
                       (State.CLOSED, Input.HEARTBEAT_AHEAD)}


def test_stale_snapshot_then_buffered_gap_stays_desynced() -> None:
    """LOAD reaches SYNCED only if the buffered deltas continue the snapshot; the missing
    delta, retransmitted, then applies with the buffered one that continues it."""
    w = holding()  # at 3, holding 5
    events = _feed(w, w.engine.snapshots[2])  # stale and older: 3 and 4 are missing after it
    assert [type(e) for e in events][:2] == [ev.SnapshotLoaded, ev.GapDetected]
    assert w.replica.state is State.DESYNCED and w.replica.seq == 2
    events = _feed(w, w.engine.deltas[3])  # in order: applies; 4 is still missing
    assert [type(e) for e in events][:2] == [ev.Applied, ev.GapDetected]
    assert w.replica.state is State.DESYNCED and w.replica.seq == 3
    events = _feed(w, w.engine.deltas[4])  # now 4 and the buffered 5 apply
    assert [type(e) for e in events] == [ev.Applied, ev.Applied]
    assert w.replica.state is State.SYNCED and w.replica.seq == 5
    assert w.replica.data is not None and w.replica.data.digest == w.digest_at(1, 5)
    assert requests_equal(replica_request(w.replica), w.engine.requests[5])


def test_retransmitted_deltas_recover_a_desynced_replica_without_a_snapshot() -> None:
    """Lost deltas sent again, out of order and duplicated: each in-order one applies
    with every buffered delta that continues it; the snapshot request is withdrawn."""
    w = synced()  # at 3
    w.engine.upto(8)
    d = w.engine.deltas
    assert isinstance(_feed(w, d[6], 1.0)[0], ev.GapDetected)  # 4 and 5 lost
    _feed(w, d[8], 1.0)  # 7 lost too
    assert [type(e) for e in w.replica.poll(1.1)] == []  # asked for a snapshot already
    events = _feed(w, d[5], 2.0)  # a retransmission overtaking another: still a gap
    assert w.replica.state is State.DESYNCED and isinstance(events[0], ev.Buffered)
    events = _feed(w, d[4], 2.0)  # 4, then the buffered 5 and 6; 7 is missing
    assert [e.seq for e in events if isinstance(e, ev.Applied)] == [4, 5, 6]
    assert ev.GapDetected(7, 8) in events and w.replica.state is State.DESYNCED
    assert _feed(w, d[5], 2.0) == [ev.Buffered(5)]  # stale now: held, never applied
    events = _feed(w, d[7], 3.0)  # 7, then the buffered 8
    assert [e.seq for e in events if isinstance(e, ev.Applied)] == [7, 8]
    assert w.replica.state is State.SYNCED and w.replica.seq == 8
    assert w.replica.data is not None and w.replica.data.digest == w.digest_at(1, 8)
    assert w.replica.data.digest == w.replica.data.recompute_digest()
    assert requests_equal(replica_request(w.replica), w.engine.requests[8])
    assert w.replica.last is d[8]
    assert not any(isinstance(e, ev.NeedSnapshot) for e in w.replica.poll(60.0))
    assert [type(e) for e in _feed(w, w.engine.step(), 61.0)] == [ev.Applied]


def test_a_rejected_delta_changes_nothing_and_its_true_copy_then_applies() -> None:
    """A delta whose digest differs is refused with the state exactly as it was (two-phase
    application); the genuine delta, sent again, applies: no snapshot needed."""
    w = synced()  # at 3
    d4 = w.engine.step()
    before = state_fingerprint(w.replica.data)  # type: ignore[arg-type]
    tampered = Delta(d4.epoch, d4.seq, d4.digest ^ 1, d4.body)
    events = _feed(w, tampered)
    assert isinstance(events[0], ev.RejectedDelta) and w.replica.state is State.DESYNCED
    assert state_fingerprint(w.replica.data) == before  # type: ignore[arg-type]
    assert w.replica.seq == 3 and w.replica.applied is None
    assert _feed(w, d4) == [ev.Applied(4)]
    assert w.replica.state is State.SYNCED and w.replica.data.digest == d4.digest  # type: ignore[union-attr]
    assert requests_equal(replica_request(w.replica), w.engine.requests[4])


def test_a_delta_its_profile_check_refuses_changes_nothing() -> None:
    """``check`` (the reference worker's: the extension decodes, SPEC 6.4) runs before
    the Delta applies: an extension that is not a map of bytes is refused with the
    state as it was, and the genuine Delta then applies (it was found only when the
    worker rebuilt the step, after its state had moved on)."""
    w = synced()  # at 3
    w.replica.check = lambda delta: decode_extension(delta.body)
    d4 = w.engine.step()
    before = state_fingerprint(w.replica.data)  # type: ignore[arg-type]
    for junk in (b"\xc1", msgspec.msgpack.encode({"k": 1}), msgspec.msgpack.encode([b"x"])):
        bad = Delta(d4.epoch, d4.seq, d4.digest, msgspec.structs.replace(d4.body,
                                                                           extension=junk))
        events = _feed(w, bad)
        assert isinstance(events[0], ev.RejectedDelta) and "extension" in events[0].reason
        assert state_fingerprint(w.replica.data) == before  # type: ignore[arg-type]
        assert w.replica.seq == 3
    assert _feed(w, d4) == [ev.Applied(4)]
    assert requests_equal(replica_request(w.replica), w.engine.requests[4])


def test_a_replica_started_at_the_epoch_start_needs_no_snapshot() -> None:
    """``start=(epoch, state)``: SYNCED at seq 0, the epoch's deltas apply from the first;
    ``applied`` and ``last`` hold the last applied delta's record, ``applied`` only
    right after it; another epoch desyncs it as any synced replica."""
    w = started()
    assert w.replica.poll(0.0) == []  # nothing to ask for
    for seq in (1, 2, 3):
        delta = _delta(w, seq)
        assert delta is not None and _feed(w, delta) == [ev.Applied(seq)]
        assert w.replica.last is delta and w.replica.applied is not None
        assert requests_equal(replica_request(w.replica), w.engine.requests[seq])
    _feed(w, w.engine.heartbeat())
    assert w.replica.applied is None and w.replica.last is w.engine.deltas[3]
    assert w.replica.data is not None and w.replica.data.digest == w.digest_at(1, 3)
    events = _feed(w, w.restarted.deltas[1])
    assert isinstance(events[0], ev.EpochChanged) and w.replica.state is State.DESYNCED


@pytest.mark.parametrize("situation", [fresh, synced, started, desynced, rejected, holding,
                                       closed, reopened])
def test_hello_major_version(situation: Callable[[], World]) -> None:
    w = situation()
    before = _observable(w.replica)
    assert _feed(w, Hello(epoch=1, seq=0, major=PROTOCOL_MAJOR, minor=PROTOCOL_MINOR + 5)) == []
    assert _observable(w.replica) == before
    with pytest.raises(IncompatibleVersion) as err:
        _feed(w, Hello(epoch=1, seq=0, major=PROTOCOL_MAJOR + 1))
    assert (err.value.ours, err.value.theirs) == (PROTOCOL_MAJOR, PROTOCOL_MAJOR + 1)
    assert _observable(w.replica) == before


@pytest.mark.parametrize("epoch", [1, 2])
@pytest.mark.parametrize("situation", [synced, started, desynced, holding, closed])
def test_worker_to_engine_messages_are_refused(situation: Callable[[], World],
                                               epoch: int) -> None:
    w = situation()
    before = _observable(w.replica)
    for msg in (CheckIn(epoch=epoch, seq=3, rank=0), SnapshotRequest(epoch=epoch, seq=3)):
        with pytest.raises(RemoteProtocolError):
            w.replica.receive(msg, 1.0)
        assert _observable(w.replica) == before
