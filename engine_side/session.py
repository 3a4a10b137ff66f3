"""EngineSession: one engine incarnation's step loop over an EngineTransport.

Owns the mirror, the transport and the liveness view, all on one thread: the
loop services the ROUTER (snapshots, check-ins, step results) while it waits
for a step, and publishes heartbeats when idle, so snapshot requests are
answered promptly by the thread that owns the mirror.

Stepping is lock-step (engine-token mode): ``run_step(request)`` publishes the
step's delta and waits until every rank *in the wait set* has returned its
sampled tokens.  The wait set of step S holds the live ranks that joined before
S: a rank served a snapshot at seq S' (which it recomputes rather than
executes) is waited for from S' + 1; a rank that answers step S is waited for
from S on; a dead, stuck or departed rank is dropped at once.  Tokens come from
the lowest rank that answered; every other answer -- including late ones, up
to ``history`` steps back -- is compared with them, and a mismatch names the
diverging rank.

Who may speak for which rank is :class:`engine_side.peers.PeerBook`'s decision: a
message from a principal that may not speak for the rank it names is dropped and
counted, never acted on; snapshot requests are rate-limited per principal, and a
principal refused too often is muted (its frames dropped undecoded).  A step result
for the pending step is checked (``validate``, :mod:`engine_side.results`) before it
counts as an answer: a bad one is its rank's fault (:class:`BadResult`, listed with
the divergent ranks, and the rank leaves the wait set), never an exception here.
Liveness deadlines are not judged while the ROUTER is backlogged (the check-ins may
be in the queue), up to the liveness bound.

If nobody can answer step S (every rank that could died, and the ranks alive
joined after S), the session re-issues the same request as a new step: its KV
writes are idempotent, so a freshly rejoined rank can answer it.  If no rank is
alive at all for ``orphan_timeout`` seconds, :class:`WorkersLost` is raised:
never a hang.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from engine_side.liveness import (
    LivenessEvent,
    LivenessView,
    WorkerDead,
    WorkerJoined,
    WorkerStuck,
)
from engine_side.mirror import EngineMirror
from engine_side.peers import (
    BAD_RESULT,
    RATE_LIMITED,
    SECOND_SESSION,
    UNDECODABLE,
    PeerBook,
    Principal,
    declared_pid,
)
from engine_side.request_diff import RequestDiffer
from protocol.messages import CheckIn, Goodbye, Heartbeat, Hello, SnapshotRequest
from protocol.replies import AnyReply, StepResult
from protocol.request import ExecuteModelRequest

if TYPE_CHECKING:  # the session never touches zmq itself
    from engine_side.results import Validator
    from engine_side.transport import EngineTransport

log = logging.getLogger("deltacast.engine")

Tick = Callable[[float], list[LivenessEvent]]

DEFAULT_ACK_SPIN = 1.0  # seconds after a publish that wait_step polls without blocking


class WorkersLost(RuntimeError):
    """No worker has been alive to answer a step for ``orphan_timeout`` seconds."""


class WorkerDied(RuntimeError):
    """A worker died and the session runs with ``strict=True`` (no supervisor)."""

    def __init__(self, event: WorkerDead) -> None:
        super().__init__(f"worker rank {event.rank} (pid {event.pid}) is dead: {event.reason}")
        self.event = event


@dataclass(frozen=True)
class Diverged:
    """``rank`` sampled different tokens than the token source for step ``seq``."""

    rank: int
    seq: int
    source_rank: int


@dataclass(frozen=True)
class BadResult(Diverged):
    """``rank`` answered step ``seq`` with a result that does not fit it (``reason``);
    ``source_rank`` is -1.  Counted as a divergence: the rank is at fault."""

    reason: str = ""


class EngineSession:
    """Lock-step engine loop (see the module docstring).

    Args:
        transport: bound sockets; the session closes them.
        mirror: the engine's EngineMirror (engine-token mode for the demo).
        liveness: per-worker view; its events go to ``on_event`` after the
            session has updated its wait set.
        on_event: called with every LivenessEvent and Diverged.
        ticks: called each service round with ``now``; may return liveness events
            (the demo's supervisor reports exited processes this way).
        strict: raise :class:`WorkerDied` (after ``on_event``) as soon as a worker
            is found dead, instead of carrying on without it.
        ranks: the ranks that exist (None: any); a message naming another is refused.
        validate: checks a result for the pending step against its request
            (:mod:`engine_side.results`); None checks epoch and seq only.
        peers: the binding and rate rules (default: a PeerBook over ``ranks`` with the
            transport's pinned keys).
    """

    def __init__(self, transport: EngineTransport, mirror: EngineMirror,
                 liveness: LivenessView | None = None, *, heartbeat_interval: float = 0.05,
                 orphan_timeout: float = 30.0,
                 on_event: Callable[[object], None] | None = None,
                 ticks: list[Tick] | None = None, history: int = 4096, strict: bool = False,
                 ack_spin: float = DEFAULT_ACK_SPIN,
                 clock: Callable[[], float] = time.monotonic,
                 ranks: range | frozenset[int] | None = None,
                 validate: Validator | None = None, peers: PeerBook | None = None) -> None:
        self.transport, self.mirror = transport, mirror
        self.peers = peers or PeerBook(ranks, getattr(transport, "pinned", None))
        self.validate = validate
        self._request: ExecuteModelRequest | None = None  # the pending step's
        self._behind_since: float | None = None
        self.differ = RequestDiffer(mirror)
        self.liveness = liveness or LivenessView()
        self.heartbeat_interval, self.orphan_timeout = heartbeat_interval, orphan_timeout
        self.on_event = on_event or (lambda event: None)
        self.ticks = ticks or []
        self.history, self.clock, self.strict = history, clock, strict
        self.ack_spin = ack_spin
        self.joined_at: dict[int, int] = {}
        self.answers: dict[int, StepResult] = {}  # pending step's answers by rank
        self.expected: OrderedDict[int, tuple[bytes, bytes, int]] = OrderedDict()
        self.snapshots_by_identity: Counter[bytes] = Counter()
        self.stats: Counter[str] = Counter()
        self.divergent: list[Diverged] = []
        self.goodbyes: set[int] = set()
        self.rank_of: dict[bytes, int] = {}  # DEALER identity -> rank
        self._last_publish = self._step_published = -1.0
        self._pending = -1
        self._cpu0 = time.process_time()
        if hasattr(transport, "on_fault"):  # an undecodable message counts against its sender
            transport.on_fault = lambda peer, exc: self._refuse(peer, UNDECODABLE, "")
        self.cpu_seconds = 0.0  # this process's CPU time (all threads) until close()

    # -- stepping -------------------------------------------------------------------------
    def run_step(self, request: ExecuteModelRequest) -> StepResult:
        """Publish ``request`` and return the token source's answer (re-issuing if needed)."""
        while True:
            seq = self.publish_step(request)
            answer = self.wait_step(seq)
            if answer is not None:
                return answer
            self.stats["reissued"] += 1
            request = msgspec.structs.replace(
                request, finished_req_ids=frozenset(), preempted_req_ids=frozenset(),
                resumed_req_ids=frozenset())

    def publish_step(self, request: ExecuteModelRequest,
                     changes: dict[str, Any] | None = None) -> int:
        """Publish the step ``request``; ``changes`` (its :meth:`EngineMirror.step`
        arguments, as an engine that knows them passes them) skips diffing it."""
        delta = self.differ.diff(request) if changes is None else \
            self.mirror.step(**changes)[0]
        self._request = request
        self.stats["bytes"] += self.transport.publish(delta)
        self.stats["steps"] += 1
        self._step_published = now = self.clock()
        if self.transport.ring is None:  # a Delta on PUB proves the subscription like a
            self._last_publish = now     # Heartbeat; through the ring, PUB stays quiet
        self.liveness.engine_at(delta.seq, now)
        self._pending, self.answers = delta.seq, {}
        return delta.seq

    def wait_step(self, seq: int) -> StepResult | None:
        """Service until step ``seq`` is answered by its wait set; None = re-issue it."""
        orphaned_since: float | None = None
        while True:
            waiting = self.wait_set(seq)
            if self.answers and waiting <= set(self.answers):
                return self._complete(seq)
            now = self.clock()
            if not waiting and not self.answers:
                if any(r in self.joined_at for r in self.liveness.alive_ranks()):
                    return None  # only later joiners are alive: re-issue the step
                orphaned_since = orphaned_since if orphaned_since is not None else now
                if now - orphaned_since > self.orphan_timeout:
                    raise WorkersLost(f"no live worker could answer step {seq} for "
                                      f"{self.orphan_timeout:.1f} s (ranks seen: "
                                      f"{sorted(self.liveness.workers)})")
            else:
                orphaned_since = None
            self.service(0.02, spin=self.ack_spin - (now - self._step_published))

    def wait_set(self, seq: int) -> set[int]:
        alive = self.liveness.alive_ranks()
        return {r for r, first in self.joined_at.items() if first <= seq and r in alive}

    def _complete(self, seq: int) -> StepResult:
        source = self.answers[min(self.answers)]
        self.expected[seq] = (source.rows, source.tokens, source.rank)
        while len(self.expected) > self.history:
            self.expected.popitem(last=False)
        for result in self.answers.values():
            self._compare(result)
        self._pending = -1
        return source

    def _compare(self, result: StepResult) -> None:
        want = self.expected.get(result.seq)
        if want is None:
            self.stats["uncompared"] += 1
            return
        self.stats["compared"] += 1
        self.stats["rejoined_compared"] += result.rejoined
        if (result.rows, result.tokens) != want[:2]:
            self.stats["mismatched"] += 1
            event = Diverged(result.rank, result.seq, want[2])
            self.divergent.append(event)
            log.error("rank %d diverged at step %d (token source: rank %d)",
                      event.rank, event.seq, event.source_rank)
            self.on_event(event)

    def _bad_result(self, peer: bytes, result: StepResult, reason: str) -> None:
        """A result for the pending step that does not fit it: the rank's fault."""
        self.stats["bad_results"] += 1
        self._refuse(peer, BAD_RESULT, f"rank {result.rank}, step {result.seq}: {reason}")
        event = BadResult(result.rank, result.seq, -1, reason)
        self.divergent.append(event)
        self.answers.pop(result.rank, None)
        self.joined_at.pop(result.rank, None)  # not waited for; a good answer rejoins it
        log.error("rank %d sent a bad result for step %d: %s", result.rank, result.seq, reason)
        self.on_event(event)

    # -- servicing ---------------------------------------------------------------------------
    def service(self, timeout: float, spin: float = 0.0) -> None:
        """One round: heartbeat if due, worker messages (``spin`` > 0: polled without
        blocking for up to that long first, at most ``timeout``), timers."""
        now = self.clock()
        if now - self._last_publish >= self.heartbeat_interval:
            epoch, seq, digest = self.mirror.heartbeat_fields()
            self.transport.publish(Heartbeat(epoch=epoch, seq=seq, digest=digest))
            self._last_publish = now
            self.stats["heartbeats"] += 1
        for identity, principal, msg in self._recv(int(timeout * 1000), min(spin, timeout)):
            self._dispatch(identity, msg, principal)
        now = self.clock()
        events = [e for tick in self.ticks for e in tick(now)]
        if not self._behind(now):
            events += self.liveness.poll(now)
        for event in events:
            self._liveness_event(event)

    def _recv(self, timeout_ms: int, spin: float = 0.0
              ) -> list[tuple[bytes, Principal, AnyReply]]:
        recv_from = getattr(self.transport, "recv_from", None)
        if recv_from is None:  # a transport that vouches for nobody (tests)
            return [(i, None, m) for i, m in self.transport.recv(timeout_ms, spin)]
        return recv_from(timeout_ms, spin)  # type: ignore[no-any-return]

    def _behind(self, now: float) -> bool:
        """Whether the ROUTER was left backlogged (check-ins may be waiting in it): then
        silence is not judged, for at most the liveness bound."""
        if not getattr(self.transport, "backlog", False):
            self._behind_since = None
            return False
        if self._behind_since is None:
            self._behind_since = now
        self.stats["backlogged_rounds"] += 1
        return now - self._behind_since < self.liveness.dead_after

    def _refuse(self, peer: bytes, reason: str, detail: str) -> None:
        self.stats["refused"] += 1
        if self.peers.refuse(peer, reason, self.clock(), detail):
            mute = getattr(self.transport, "mute", None)
            if mute is not None:
                mute(peer, self.peers.mute_s)

    def _pid(self, identity: bytes, principal: Principal, msg: AnyReply) -> int | None:
        """The process a message comes from: the kernel's word on ipc, else a check-in's
        pid, else the pid a core worker's DEALER names itself with."""
        if principal is not None and principal.startswith(b"pid:"):
            return int(principal[4:])
        if isinstance(msg, CheckIn):
            return msg.pid
        return declared_pid(identity)

    def _claim(self, identity: bytes, principal: Principal, msg: AnyReply, rank: int) -> bool:
        """Whether the sender may speak for ``rank`` (:meth:`PeerBook.claim`); a refusal
        is counted against it."""
        pid = self._pid(identity, principal, msg)
        why: str | None = None
        if isinstance(msg, CheckIn) and pid != msg.pid:
            why = SECOND_SESSION  # a check-in naming a process it does not come from
        else:
            view = self.liveness.workers.get(rank)
            why = self.peers.claim(principal, rank, pid,
                                   view.pid if view is not None and view.alive else None)
        if why is not None:
            self._refuse(principal if principal is not None else identity, why,
                         f"{type(msg).__name__} for rank {rank} (pid {pid})")
        return why is None

    def _dispatch(self, identity: bytes, msg: AnyReply, principal: Principal = None) -> None:
        now = self.clock()
        peer = principal if principal is not None else identity
        if isinstance(msg, Goodbye):  # it names no rank: the one its sender speaks for
            rank = self.peers.rank_of(principal)
            rank = self.rank_of.get(identity) if rank is None else rank
            if rank is not None and self._claim(identity, principal, msg, rank):
                self.goodbyes.add(rank)
                self.joined_at.pop(rank, None)
                self.liveness.left(rank)
            return
        if not isinstance(msg, CheckIn | SnapshotRequest | StepResult):
            self._refuse(peer, "unexpected " + type(msg).__name__, "")
            return
        if not self._claim(identity, principal, msg, msg.rank):
            return
        if isinstance(msg, CheckIn):
            self.stats["checkins"] += 1
            for event in self.liveness.check_in(msg.rank, msg.pid, msg.seq, msg.state, now):
                self._liveness_event(event)
        elif isinstance(msg, SnapshotRequest):
            if not self.peers.allow_snapshot((peer, msg.rank), now):
                self._refuse(peer, RATE_LIMITED, f"a snapshot request for rank {msg.rank}")
                return
            self.rank_of[identity] = msg.rank
            self._serve_snapshot(identity, msg.rank)
        else:
            if identity:  # b"": it came through a reply ring (its DEALER is known already)
                self.rank_of[identity] = msg.rank
            self._step_result(msg, peer)

    def _serve_snapshot(self, identity: bytes, rank: int) -> None:
        """Hello (version and features, checked by the worker), then the snapshot."""
        epoch, seq, _ = self.mirror.heartbeat_fields()
        self.transport.send_to(identity, Hello(epoch=epoch, seq=seq, role="engine"))
        self.stats["bytes_snapshots"] += self.transport.send_to(identity, self.mirror.snapshot())
        self.stats["snapshots"] += 1
        if self.snapshots_by_identity[identity]:
            self.stats["resyncs"] += 1
            self.stats[f"resyncs_rank{rank}"] += 1
        self.snapshots_by_identity[identity] += 1
        self.joined_at[rank] = self.mirror.seq + 1

    def _step_result(self, msg: StepResult, peer: bytes) -> None:
        if msg.epoch != self.mirror.epoch:
            self.stats["other_epoch"] += 1  # a worker not yet resynced to this engine
            return
        if msg.seq == self._pending:
            problem = (self.validate(self._request, msg)
                       if self.validate is not None and self._request is not None else None)
            if problem is not None:
                self._bad_result(peer, msg, problem)
                return
            self.answers[msg.rank] = msg
            if self.joined_at.get(msg.rank, msg.seq + 1) > msg.seq:
                self.joined_at[msg.rank] = msg.seq
        elif msg.seq > self.mirror.seq:
            self._refuse(peer, BAD_RESULT, f"a result for step {msg.seq}, not yet published")
        else:
            self._compare(msg)

    def _liveness_event(self, event: LivenessEvent) -> None:
        # A first check-in may arrive after this incarnation was served its snapshot (it
        # comes on another socket): only an incarnation that replaces a live one is stale.
        stale = isinstance(event, WorkerJoined) and event.replaces is not None
        if stale or isinstance(event, (WorkerDead, WorkerStuck)):
            self.joined_at.pop(event.rank, None)
        self.on_event(event)
        if self.strict and isinstance(event, WorkerDead):
            raise WorkerDied(event)

    def refusals(self) -> dict[str, int]:
        """Worker messages not acted on, by reason: the peer rules' refusals, frames that
        do not decode, frames of muted peers dropped undecoded, CURVE handshakes refused."""
        out = dict(self.peers.refused)
        auth = getattr(self.transport, "auth", None)  # the ZAP handler counts handshakes
        for name, count in (("muted", getattr(self.transport, "muted_drops", 0)),
                            ("handshakes", getattr(auth, "rejected", 0))):
            if count:
                out[name] = count
        return out

    # -- lifecycle ---------------------------------------------------------------------------
    def wait_for_workers(self, count: int, timeout: float) -> None:
        """Service until ``count`` ranks have been served a snapshot (WorkersLost after timeout)."""
        deadline = self.clock() + timeout
        while len(self.joined_at) < count:
            if self.clock() > deadline:
                raise WorkersLost(f"only {len(self.joined_at)} of {count} workers joined "
                                  f"within {timeout:.0f} s")
            self.service(0.02)

    def close(self, reason: str = "shutdown", expect: set[int] | None = None,
              timeout: float = 2.0) -> None:
        """Say Goodbye, wait (bounded) for ``expect`` ranks' Goodbyes, close the sockets."""
        epoch, seq, _ = self.mirror.heartbeat_fields()
        self.transport.publish(Goodbye(epoch=epoch, seq=seq, reason=reason))
        deadline = self.clock() + timeout
        while expect and not expect <= self.goodbyes and self.clock() < deadline:
            for identity, principal, msg in self._recv(20):
                self._dispatch(identity, msg, principal)
        self.cpu_seconds = time.process_time() - self._cpu0
        self.transport.close()
