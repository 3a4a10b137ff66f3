"""WorkerReplica: the worker's table-driven sync state machine (sans-I/O).

Theory of operation
-------------------
Every received message is first *classified* against the replica (in-order
delta, stale delta, gap, new epoch, snapshot, heartbeat, goodbye).  The pair
(state, input) is then looked up in ``TRANSITIONS``, which names the action and
the next state.  A pair missing from the table is a documented error: the
replica raises LocalProtocolError and keeps its state (see SPEC.md §9).

Rules (SPEC.md §8): a delta applies only when its base (``seq - 1``) equals the
replica's seq; duplicates and stale deltas are discarded; a gap, a new epoch, an
invalid delta or a digest mismatch makes the replica DESYNCED, buffering deltas
(bounded) meanwhile.  It recovers either way the transport arranges: a snapshot
(the buffered deltas above it then apply while contiguous), or the missing deltas
themselves, retransmitted (a DESYNCED replica applies an in-order delta, then the
buffered ones that continue it).  ``applied`` holds what the last applied delta
did; a receiver never builds a step across a gap: it is only set right after an
Applied event while SYNCED.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable

from protocol.errors import (
    IncompatibleVersion,
    InvalidDelta,
    ProtocolError,
    RemoteProtocolError,
)
from protocol.messages import (
    PROTOCOL_MAJOR,
    AnyMessage,
    Delta,
    Goodbye,
    Heartbeat,
    Hello,
    Snapshot,
)
from protocol.snapshot import load_snapshot
from protocol.state import Applied, ReplicaState
from worker_side import events as ev


class State(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-speed TRANSITIONS lookups
    #: Joined (or restarted) and holding no state yet; deltas are buffered.
    AWAITING_SNAPSHOT = "awaiting_snapshot"
    #: State equals the engine's at ``seq``; in-order deltas apply.
    SYNCED = "synced"
    #: A gap, new epoch or bad delta was seen; waiting for a snapshot.
    DESYNCED = "desynced"
    #: The engine said Goodbye; a snapshot (a new epoch's, or a newer one) revives it.
    CLOSED = "closed"


class Input(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-speed TRANSITIONS lookups
    DELTA_IN_ORDER = "delta_in_order"
    DELTA_STALE = "delta_stale"
    DELTA_GAP = "delta_gap"
    NEW_EPOCH = "new_epoch"
    SNAPSHOT = "snapshot"
    SNAPSHOT_STALE = "snapshot_stale"
    HEARTBEAT = "heartbeat"
    HEARTBEAT_AHEAD = "heartbeat_ahead"
    HELLO = "hello"
    GOODBYE = "goodbye"


class Action(enum.Enum):
    __hash__ = object.__hash__  # members are singletons: C-speed TRANSITIONS lookups
    APPLY = "apply"
    DISCARD = "discard"
    BUFFER = "buffer"
    DESYNC = "desync"
    LOAD = "load"
    NOTE = "note"
    CHECK_HELLO = "check_hello"
    CLOSE = "close"


S, In, A = State, Input, Action
#: The normative transition table (SPEC.md §9 mirrors it; a test compares them).
TRANSITIONS: dict[tuple[State, Input], tuple[Action, State]] = {
    (S.AWAITING_SNAPSHOT, In.DELTA_IN_ORDER): (A.BUFFER, S.AWAITING_SNAPSHOT),
    (S.AWAITING_SNAPSHOT, In.DELTA_STALE): (A.BUFFER, S.AWAITING_SNAPSHOT),
    (S.AWAITING_SNAPSHOT, In.DELTA_GAP): (A.BUFFER, S.AWAITING_SNAPSHOT),
    (S.AWAITING_SNAPSHOT, In.NEW_EPOCH): (A.BUFFER, S.AWAITING_SNAPSHOT),
    (S.AWAITING_SNAPSHOT, In.SNAPSHOT): (A.LOAD, S.SYNCED),
    (S.AWAITING_SNAPSHOT, In.SNAPSHOT_STALE): (A.LOAD, S.SYNCED),
    (S.AWAITING_SNAPSHOT, In.HEARTBEAT): (A.NOTE, S.AWAITING_SNAPSHOT),
    (S.AWAITING_SNAPSHOT, In.HEARTBEAT_AHEAD): (A.NOTE, S.AWAITING_SNAPSHOT),
    (S.AWAITING_SNAPSHOT, In.HELLO): (A.CHECK_HELLO, S.AWAITING_SNAPSHOT),
    (S.AWAITING_SNAPSHOT, In.GOODBYE): (A.CLOSE, S.CLOSED),
    (S.SYNCED, In.DELTA_IN_ORDER): (A.APPLY, S.SYNCED),
    (S.SYNCED, In.DELTA_STALE): (A.DISCARD, S.SYNCED),
    (S.SYNCED, In.DELTA_GAP): (A.DESYNC, S.DESYNCED),
    (S.SYNCED, In.NEW_EPOCH): (A.DESYNC, S.DESYNCED),
    (S.SYNCED, In.SNAPSHOT): (A.LOAD, S.SYNCED),
    (S.SYNCED, In.SNAPSHOT_STALE): (A.DISCARD, S.SYNCED),
    (S.SYNCED, In.HEARTBEAT): (A.NOTE, S.SYNCED),
    (S.SYNCED, In.HEARTBEAT_AHEAD): (A.DESYNC, S.DESYNCED),
    (S.SYNCED, In.HELLO): (A.CHECK_HELLO, S.SYNCED),
    (S.SYNCED, In.GOODBYE): (A.CLOSE, S.CLOSED),
    (S.DESYNCED, In.DELTA_IN_ORDER): (A.APPLY, S.SYNCED),
    (S.DESYNCED, In.DELTA_STALE): (A.BUFFER, S.DESYNCED),
    (S.DESYNCED, In.DELTA_GAP): (A.BUFFER, S.DESYNCED),
    (S.DESYNCED, In.NEW_EPOCH): (A.BUFFER, S.DESYNCED),
    (S.DESYNCED, In.SNAPSHOT): (A.LOAD, S.SYNCED),
    (S.DESYNCED, In.SNAPSHOT_STALE): (A.LOAD, S.SYNCED),
    (S.DESYNCED, In.HEARTBEAT): (A.NOTE, S.DESYNCED),
    (S.DESYNCED, In.HEARTBEAT_AHEAD): (A.NOTE, S.DESYNCED),
    (S.DESYNCED, In.HELLO): (A.CHECK_HELLO, S.DESYNCED),
    (S.DESYNCED, In.GOODBYE): (A.CLOSE, S.CLOSED),
    (S.CLOSED, In.NEW_EPOCH): (A.BUFFER, S.AWAITING_SNAPSHOT),
    (S.CLOSED, In.SNAPSHOT): (A.LOAD, S.SYNCED),
    (S.CLOSED, In.DELTA_STALE): (A.DISCARD, S.CLOSED),
    (S.CLOSED, In.HEARTBEAT): (A.NOTE, S.CLOSED),
    (S.CLOSED, In.GOODBYE): (A.NOTE, S.CLOSED),
    (S.CLOSED, In.HELLO): (A.CHECK_HELLO, S.CLOSED),
}
# Missing on purpose: (CLOSED, DELTA_IN_ORDER / DELTA_GAP / SNAPSHOT_STALE /
# HEARTBEAT_AHEAD): the engine said Goodbye and then kept talking in the same
# epoch.  That is a remote protocol violation; see WorkerReplica.receive.


class WorkerReplica:
    """A worker's replica of the engine state.

    Args:
        silence_timeout: seconds without any engine message before EngineSilent.
        snapshot_retry: seconds before a pending NeedSnapshot is repeated.
        max_buffer: deltas kept while waiting for a snapshot (oldest dropped).
        start: ``(epoch, state)``: begin SYNCED at seq 0 of that epoch with that (empty)
            state -- a receiver that exists from the epoch's start and never joins late
            (a vLLM rank); None: AWAITING_SNAPSHOT.
        on_event: called with each SnapshotLoaded and Applied event the moment it
            happens, while ``data`` (and ``applied``, ``last``) are that state -- one
            ``receive`` may load a snapshot and apply several buffered deltas, and a
            receiver that acts per step must act on each.
        check: called with each in-order Delta before it applies (its profile's
            step-only fields, e.g. the extension); a ProtocolError it raises refuses
            the Delta as a failed state check does, the state unchanged.
    """

    def __init__(self, silence_timeout: float = 1.0, snapshot_retry: float = 0.5,
                 max_buffer: int = 4096, start: tuple[int, ReplicaState] | None = None,
                 on_event: Callable[[ev.Event], None] | None = None,
                 check: Callable[[Delta], object] | None = None) -> None:
        self.on_event, self.check = on_event, check
        self.state = State.AWAITING_SNAPSHOT
        self.epoch = -1
        self.seq = -1
        self.data: ReplicaState | None = None
        self.applied: Applied | None = None  # what the last applied delta did
        self.last: Delta | None = None  # and that delta
        if start is not None:
            self.state, (self.epoch, self.data), self.seq = State.SYNCED, start, 0
        self.silence_timeout = silence_timeout
        self.snapshot_retry = snapshot_retry
        self._buffer: deque[Delta] = deque(maxlen=max_buffer)
        self._last_heard: float | None = None
        self._silent_reported = False
        self._need_since: float | None = None
        self.stats = {"applied": 0, "discarded": 0, "gaps": 0, "rejected": 0, "snapshots": 0}

    # -- input ---------------------------------------------------------------------
    def classify(self, msg: AnyMessage) -> Input:
        """Which table input ``msg`` is for this replica, right now."""
        if type(msg) is Delta and msg.epoch == self.epoch and msg.seq == self.seq + 1:
            return Input.DELTA_IN_ORDER  # the common case, decided first
        if isinstance(msg, Hello):
            return Input.HELLO
        if not isinstance(msg, (Goodbye, Snapshot, Heartbeat, Delta)):  # worker -> engine only
            raise RemoteProtocolError("not a message for a worker", type=type(msg).__name__)
        if isinstance(msg, Goodbye):
            return Input.GOODBYE if msg.epoch == self.epoch or self.epoch < 0 else Input.NEW_EPOCH
        fresh_epoch = self.epoch >= 0 and msg.epoch != self.epoch
        if isinstance(msg, Snapshot):
            stale = not fresh_epoch and self.epoch >= 0 and msg.seq <= self.seq
            return Input.SNAPSHOT_STALE if stale else Input.SNAPSHOT
        if fresh_epoch:
            return Input.NEW_EPOCH
        if isinstance(msg, Heartbeat):
            ahead = self.seq >= 0 and msg.seq > self.seq
            return Input.HEARTBEAT_AHEAD if ahead else Input.HEARTBEAT
        if msg.seq <= self.seq:
            return Input.DELTA_STALE
        return Input.DELTA_IN_ORDER if msg.seq == self.seq + 1 else Input.DELTA_GAP

    def receive(self, msg: AnyMessage, now: float) -> list[ev.Event]:
        """Feed one decoded engine message; returns what happened.

        Raises IncompatibleVersion for a Hello of another major version and
        RemoteProtocolError for a message with no transition or one meant for
        the engine (CheckIn, SnapshotRequest); the state is then unchanged.
        """
        self._last_heard, self._silent_reported = now, False
        self.applied = None
        if type(msg) is Delta and msg.epoch == self.epoch and msg.seq == self.seq + 1:
            kind = Input.DELTA_IN_ORDER  # the common case: classify's first test, inlined
        else:
            kind = self.classify(msg)
        entry = TRANSITIONS.get((self.state, kind))
        if entry is None:
            raise RemoteProtocolError("message not allowed in this state",
                                      state=self.state.value, input=kind.value, seq=msg.seq)
        action, target = entry
        if action is Action.APPLY:
            return self._apply(msg, now)  # type: ignore[arg-type]
        events = self._act(action, msg, now)
        if action not in (Action.DESYNC, Action.LOAD, Action.APPLY):
            self.state = target
        return events

    def _act(self, action: Action, msg: AnyMessage, now: float) -> list[ev.Event]:
        if action is Action.APPLY:
            assert isinstance(msg, Delta)
            return self._apply(msg, now)
        if action is Action.LOAD:
            assert isinstance(msg, Snapshot)
            return self._load(msg, now)
        if action is Action.BUFFER:
            assert isinstance(msg, (Delta, Goodbye, Heartbeat))  # new-epoch heartbeat: wait
            if isinstance(msg, Delta):
                self._buffer.append(msg)
                return [ev.Buffered(msg.seq), *self._need("waiting for snapshot", now)]
            return []
        if action is Action.DESYNC:
            return self._desync(msg, now)
        if action is Action.DISCARD:
            self.stats["discarded"] += 1
            return [ev.Discarded(msg.seq, "stale")]
        if action is Action.CHECK_HELLO:
            assert isinstance(msg, Hello)
            check_hello(msg)
            return []
        if action is Action.CLOSE:
            assert isinstance(msg, Goodbye)
            self._buffer.clear()
            return [ev.Closed(msg.reason)]
        return []  # NOTE: liveness only

    def _apply(self, delta: Delta, now: float) -> list[ev.Event]:
        """Apply an in-order delta; a DESYNCED replica then applies the buffered deltas
        that continue it (retransmission) and stays DESYNCED while a hole remains."""
        assert self.data is not None
        was = self.state
        try:
            if self.check is not None:
                self.check(delta)
            applied = self.data.apply(delta.body, expected_digest=delta.digest)
        except ProtocolError as exc:
            self.stats["rejected"] += 1
            self.state = State.DESYNCED
            return [ev.RejectedDelta(delta.seq, str(exc)), *self._need("rejected delta", now)]
        self.seq = delta.seq
        self.state = State.SYNCED
        self.stats["applied"] += 1
        self.applied, self.last = applied, delta
        done = self._happened(ev.Applied(delta.seq))
        if was is State.DESYNCED:
            self._need_since = None
            if self._buffer:
                return [done, *self._drain(now)]
        return [done]

    def _happened(self, event: ev.Event) -> ev.Event:
        if self.on_event is not None:
            self.on_event(event)
        return event

    def _desync(self, msg: AnyMessage, now: float) -> list[ev.Event]:
        self.state = State.DESYNCED
        out: list[ev.Event] = []
        if msg.epoch != self.epoch:
            out.append(ev.EpochChanged(self.epoch, msg.epoch))
        else:
            self.stats["gaps"] += 1
            out.append(ev.GapDetected(self.seq + 1, msg.seq))
        if isinstance(msg, Delta):
            self._buffer.append(msg)
        return out + self._need(type(out[0]).__name__, now)

    def _load(self, snap: Snapshot, now: float) -> list[ev.Event]:
        try:
            data = load_snapshot(snap)
        except (InvalidDelta, ProtocolError) as exc:
            self.stats["rejected"] += 1
            return [ev.RejectedDelta(snap.seq, f"snapshot: {exc}"), *self._need("bad snapshot",
                                                                                now)]
        self.data, self.epoch, self.seq = data, snap.epoch, snap.seq
        self.state = State.SYNCED
        self._need_since = None
        self.stats["snapshots"] += 1
        return [self._happened(ev.SnapshotLoaded(snap.seq)), *self._drain(now)]

    def _drain(self, now: float) -> list[ev.Event]:
        """Apply buffered deltas that continue the snapshot; stop at a gap."""
        pending = sorted((d for d in self._buffer if d.epoch == self.epoch and d.seq > self.seq),
                         key=lambda d: d.seq)
        self._buffer.clear()
        out: list[ev.Event] = []
        for i, delta in enumerate(pending):
            if delta.seq <= self.seq:
                continue  # duplicate inside the buffer
            if delta.seq != self.seq + 1:
                self._buffer.extend(pending[i:])
                self.state = State.DESYNCED
                self.stats["gaps"] += 1
                return out + [ev.GapDetected(self.seq + 1, delta.seq),
                              *self._need("gap after snapshot", now)]
            out += self._apply(delta, now)
            if self.state is not State.SYNCED:
                return out
        return out

    def _need(self, reason: str, now: float) -> list[ev.Event]:
        if self._need_since is not None:
            return []
        self._need_since = now
        return [ev.NeedSnapshot(reason)]

    # -- time and output -------------------------------------------------------------
    def poll(self, now: float) -> list[ev.Event]:
        """Timers: engine silence, and repeating an unanswered snapshot request."""
        out: list[ev.Event] = []
        heard = self._last_heard
        if heard is not None and not self._silent_reported and now - heard > self.silence_timeout:
            self._silent_reported = True
            out.append(ev.EngineSilent(now - heard))
        if self.state is State.AWAITING_SNAPSHOT and self._need_since is None:
            out += self._need("joining", now)
        elif self._need_since is not None and now - self._need_since > self.snapshot_retry:
            self._need_since = now
            out.append(ev.NeedSnapshot("retry"))
        return out


def check_hello(hello: Hello) -> int:
    """Validate a peer's Hello; returns the agreed feature bits."""
    from protocol.messages import SUPPORTED_FEATURES

    if hello.major != PROTOCOL_MAJOR:
        raise IncompatibleVersion("peer speaks another major protocol version",
                                  ours=PROTOCOL_MAJOR, theirs=hello.major)
    return hello.features & SUPPORTED_FEATURES
