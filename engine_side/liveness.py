"""The engine's per-worker liveness view (sans-I/O: every input takes ``now``).

Inputs: a worker's check-ins (rank, pid, applied seq, replica state), the
engine's newest seq, and -- for workers the engine spawned itself -- the news
that a process exited.  Output: events, returned by the input methods and by
:meth:`LivenessView.poll`.

Rules:

* **Dead**: the process exited, or no check-in for ``dead_after`` seconds
  (default 1 s).  Reported once per incarnation as :class:`WorkerDead`.
  A later check-in from the same pid is :class:`WorkerBack` (a stalled
  process that resumed); from a new pid it is a new incarnation,
  :class:`WorkerJoined`.
* **Stuck**: alive (checking in) but its applied seq has not advanced for
  ``stuck_after[phase]`` seconds while the engine is ahead, where phase is the
  replica state it reports ("awaiting_snapshot", "desynced", "synced"); or silent
  for ``stuck_after["silent"]`` seconds.  Reported once as :class:`WorkerStuck`;
  the supervisor decides (the demo kills and restarts).  The deadlines are longer
  than ``dead_after`` so a long compute step is never mistaken for either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_STUCK_AFTER: dict[str, float] = {
    "awaiting_snapshot": 5.0, "desynced": 5.0, "synced": 5.0, "closed": 5.0, "silent": 5.0,
}


@dataclass(frozen=True)
class LivenessEvent:
    rank: int


@dataclass(frozen=True)
class WorkerJoined(LivenessEvent):
    """A new incarnation (pid) of ``rank`` checked in.  ``replaces`` is the pid of an
    earlier incarnation that was still believed alive (None: first join, or after death)."""

    pid: int
    replaces: int | None = None


@dataclass(frozen=True)
class WorkerDead(LivenessEvent):
    """``rank`` is dead: its process exited or its check-ins stopped."""

    pid: int
    reason: str
    silent_for: float


@dataclass(frozen=True)
class WorkerBack(LivenessEvent):
    """A worker reported dead checked in again (same pid: it was stalled)."""

    pid: int


@dataclass(frozen=True)
class WorkerStuck(LivenessEvent):
    """Alive but not advancing (or silent) past the phase's deadline."""

    pid: int
    seq: int
    phase: str
    for_seconds: float


@dataclass
class WorkerView:
    """What the engine knows about one rank."""

    rank: int
    pid: int
    seq: int
    phase: str
    last_checkin: float
    last_advance: float
    alive: bool = True
    exited: bool = False
    stuck_reported: bool = False


class LivenessView:
    """Per-worker liveness (pure; feed it ``now``)."""

    def __init__(self, dead_after: float = 1.0,
                 stuck_after: Mapping[str, float] | None = None) -> None:
        self.dead_after = dead_after
        self.stuck_after = {**DEFAULT_STUCK_AFTER, **(stuck_after or {})}
        self.workers: dict[int, WorkerView] = {}
        self.engine_seq = 0

    def check_in(self, rank: int, pid: int, seq: int, phase: str,
                 now: float) -> list[LivenessEvent]:
        """A check-in arrived; returns WorkerJoined / WorkerBack when relevant."""
        w = self.workers.get(rank)
        if w is None or w.pid != pid:
            self.workers[rank] = WorkerView(rank, pid, seq, phase, now, now)
            return [WorkerJoined(rank, pid, w.pid if w is not None and w.alive else None)]
        out: list[LivenessEvent] = []
        if not w.alive:
            w.alive, w.stuck_reported = True, False
            w.last_advance = now
            out.append(WorkerBack(rank, pid))
        if seq != w.seq or phase != w.phase:
            w.last_advance = now
        w.seq, w.phase, w.last_checkin = seq, phase, now
        return out

    def exited(self, rank: int, pid: int, reason: str, now: float) -> list[LivenessEvent]:
        """The process of ``rank`` with ``pid`` is gone (for locally spawned workers)."""
        w = self.workers.get(rank)
        if w is None or w.pid != pid or w.exited:
            return []
        w.exited = True
        return [self._dead(w, reason, now)] if w.alive else []

    def left(self, rank: int) -> None:
        """``rank`` said Goodbye: forget it without an event."""
        self.workers.pop(rank, None)

    def engine_at(self, seq: int, now: float) -> None:
        """The engine published ``seq``; caught-up workers start their stuck clock now."""
        for w in self.workers.values():
            if w.seq >= self.engine_seq:
                w.last_advance = max(w.last_advance, now)
        self.engine_seq = seq

    def poll(self, now: float) -> list[LivenessEvent]:
        """Deadlines: dead after ``dead_after`` of silence; stuck per phase."""
        out: list[LivenessEvent] = []
        for w in self.workers.values():
            silent = now - w.last_checkin
            if w.alive and silent > self.dead_after:
                out.append(self._dead(w, f"no check-in for {silent:.2f} s", now))
            elif not w.stuck_reported and self._stuck_for(w, now) is not None:
                w.stuck_reported = True
                phase = w.phase if w.alive else "silent"
                out.append(WorkerStuck(w.rank, w.pid, w.seq, phase, self._stuck_for(w, now)
                                       or 0.0))
        return out

    def _stuck_for(self, w: WorkerView, now: float) -> float | None:
        if not w.alive:
            silent = now - w.last_checkin
            return silent if not w.exited and silent > self.stuck_after["silent"] else None
        idle = now - w.last_advance
        behind = w.seq < self.engine_seq or w.phase != "synced"
        limit = self.stuck_after.get(w.phase, self.stuck_after["synced"])
        return idle if behind and idle > limit else None

    def _dead(self, w: WorkerView, reason: str, now: float) -> WorkerDead:
        w.alive = False
        return WorkerDead(w.rank, w.pid, reason, now - w.last_checkin)

    def alive_ranks(self) -> set[int]:
        return {r for r, w in self.workers.items() if w.alive}
