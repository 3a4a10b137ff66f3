"""The worker's transition table, exhaustively (h2 style): every (State, Input) pair.

For each pair the replica is put into that state by a realistic history (a
snapshot loaded → SYNCED, a gap → DESYNCED, a Goodbye → CLOSED, a fresh or
closed-then-restarted worker → AWAITING_SNAPSHOT) and fed a real message that
classifies as that input.  The resulting state must be the table's target; for a
pair missing from ``TRANSITIONS`` the replica raises RemoteProtocolError and
changes nothing.  Whenever the replica ends SYNCED its digest must equal the
engine's at its (epoch, seq).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

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
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
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
    mirror: EngineMirror = field(init=False)
    deltas: dict[int, Delta] = field(default_factory=dict)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    heartbeats: dict[int, Heartbeat] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mirror = EngineMirror(epoch=self.epoch, verify=True)

    def step(self) -> Delta:
        delta = self.mirror.diff(_request(self.mirror.seq + 1))
        self.deltas[delta.seq] = delta
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
        return engine.snapshots[seq].digest


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


def desynced() -> World:
    """Synced at 3, then delta 5 overtook delta 4 (a gap), and 4 arrived late."""
    w = synced()
    d4, d5 = w.engine.step(), w.engine.step()
    assert isinstance(_feed(w, d5)[0], ev.GapDetected)
    _feed(w, d4)
    assert w.replica.state is State.DESYNCED
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
    State.SYNCED: [synced],
    State.DESYNCED: [desynced],
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


def test_missing_pairs_are_exactly_the_documented_ones() -> None:
    missing = {(s, i) for s in State for i in Input} - set(TRANSITIONS)
    assert missing == {(State.CLOSED, Input.DELTA_IN_ORDER), (State.CLOSED, Input.DELTA_GAP),
                       (State.CLOSED, Input.SNAPSHOT_STALE),
                       (State.CLOSED, Input.HEARTBEAT_AHEAD)}


def test_stale_snapshot_then_buffered_gap_stays_desynced() -> None:
    """LOAD reaches SYNCED only if the buffered deltas continue the snapshot."""
    w = desynced()  # at 3, holding 4 and 5
    events = _feed(w, w.engine.snapshots[2])  # stale and older: 3 is missing after it
    assert [type(e) for e in events][:2] == [ev.SnapshotLoaded, ev.GapDetected]
    assert w.replica.state is State.DESYNCED and w.replica.seq == 2
    _feed(w, w.engine.deltas[3])  # buffered
    events = _feed(w, w.engine.snapshots[2])  # now 3, 4, 5 continue it
    assert [type(e) for e in events] == [ev.SnapshotLoaded, ev.Applied, ev.Applied, ev.Applied]
    assert w.replica.state is State.SYNCED and w.replica.seq == 5


@pytest.mark.parametrize("situation", [fresh, synced, desynced, closed, reopened])
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
@pytest.mark.parametrize("situation", [synced, desynced, closed])
def test_worker_to_engine_messages_are_refused(situation: Callable[[], World],
                                               epoch: int) -> None:
    w = situation()
    before = _observable(w.replica)
    for msg in (CheckIn(epoch=epoch, seq=3, rank=0), SnapshotRequest(epoch=epoch, seq=3)):
        with pytest.raises(RemoteProtocolError):
            w.replica.receive(msg, 1.0)
        assert _observable(w.replica) == before
