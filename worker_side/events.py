"""Events a WorkerReplica reports (past-tense facts, never exceptions)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    """Base class of replica events."""


@dataclass(frozen=True)
class Applied(Event):
    """A delta was applied; ``replica.request()`` now returns step ``seq``."""

    seq: int


@dataclass(frozen=True)
class Discarded(Event):
    """A message was dropped: a duplicate, stale, or from an old epoch."""

    seq: int
    reason: str


@dataclass(frozen=True)
class Buffered(Event):
    """A delta was queued while waiting for a snapshot."""

    seq: int


@dataclass(frozen=True)
class GapDetected(Event):
    """A delta (or heartbeat) shows messages were lost; the replica is DESYNCED."""

    expected: int
    got: int


@dataclass(frozen=True)
class EpochChanged(Event):
    """The engine restarted; state must be resynced."""

    old: int
    new: int


@dataclass(frozen=True)
class RejectedDelta(Event):
    """A delta failed validation or its digest did not match; state left unchanged."""

    seq: int
    reason: str


@dataclass(frozen=True)
class SnapshotLoaded(Event):
    """The replica now equals the engine's state at ``seq``."""

    seq: int


@dataclass(frozen=True)
class NeedSnapshot(Event):
    """The transport should ask the engine for a snapshot."""

    reason: str


@dataclass(frozen=True)
class EngineSilent(Event):
    """Nothing heard from the engine for longer than the silence timeout."""

    silent_for: float


@dataclass(frozen=True)
class Closed(Event):
    """The engine said Goodbye."""

    reason: str
