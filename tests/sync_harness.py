"""The convergence harness of ``tests/test_sync_stateful.py``: a random engine workload,
the engine mirror (diffing whole requests), a lossy fake network and checked worker
replicas, every check of that test's invariants 1-4 in one place (see its docstring)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec
from engine_model import EngineModel
from fakenet import FakeNetwork
from oracle import Cache, Oracle

from engine_side.mirror import EngineMirror
from protocol import codec
from protocol.messages import Delta, Heartbeat
from protocol.rebuild import rebuild_request
from protocol.request import ExecuteModelRequest, RequestSpec, _same_value, request_differences
from protocol.state import ReplicaState
from worker_side import events as ev
from worker_side.replica import State, WorkerReplica

Key = tuple[int, int]  # (epoch, seq)


class CheckedReplica(WorkerReplica):
    """A replica that rebuilds the request right after *every* applied delta.

    ``applied``/``last`` only hold the last delta a ``receive`` call applied, but one
    call may apply several (buffered deltas after a snapshot or after a retransmitted
    one); the replica sets ``last`` right after each delta applies, so this hook sees
    every one of them, in order, and rebuilds it as a receiver would.
    """

    def __init__(self, start: tuple[int, ReplicaState] | None = None) -> None:
        self.rebuilt: list[tuple[Key, ExecuteModelRequest]] = []
        self.cache: Cache = {}
        super().__init__(silence_timeout=1.0, snapshot_retry=0.5, start=start)

    @property
    def last(self) -> Delta | None:
        return self._last

    @last.setter
    def last(self, delta: Delta | None) -> None:
        self._last = delta
        if delta is None:
            return
        assert self.data is not None and self.applied is not None and self.seq == delta.seq
        request = rebuild_request(self.data, delta.body, self.applied, self.cache)
        self.rebuilt.append(((self.epoch, delta.seq), request))


class Comparator:
    """``request_differences`` with a memo of spec pairs already found equal.

    Specs are immutable and shared across steps on both sides, so each
    (engine spec, replica spec) pair is compared deeply once; the memo keeps
    both objects alive so their ids stay unique.
    """

    def __init__(self) -> None:
        self._equal: dict[tuple[int, int], tuple[RequestSpec, RequestSpec]] = {}

    def same_spec(self, a: RequestSpec, b: RequestSpec) -> bool:
        if a is b or (id(a), id(b)) in self._equal:
            return True
        if not _same_value(a, b):  # the deep comparison request_differences uses
            return False
        self._equal[(id(a), id(b))] = (a, b)
        return True

    def differences(self, got: ExecuteModelRequest, want: ExecuteModelRequest) -> list[str]:
        rest = request_differences(msgspec.structs.replace(got, specs=[]),
                                   msgspec.structs.replace(want, specs=[]))
        same = len(got.specs) == len(want.specs) and all(
            map(self.same_spec, got.specs, want.specs))
        return rest if same else ["specs", *rest]


@dataclass
class Worker:
    replica: CheckedReplica = field(default_factory=CheckedReplica)
    anchor: Key | None = None  # last snapshot loaded or step applied (or the start)
    wants_snapshot: bool = False
    applied: int = 0
    checked: tuple[int, int, int] | None = None  # (id(data), epoch, seq) digest-checked


class Harness:
    """Engine model + mirror + fake network + checked replicas; every check is here."""

    def __init__(self, token_mode: int, kv_groups: int, workers: int,
                 started: bool = False) -> None:
        """``started``: the first workers exist from the epoch's start (``start=``) and
        need no snapshot; else they join and ask for one."""
        self.model = EngineModel(token_mode, kv_groups)
        self.oracle = Oracle(1, token_mode, kv_groups, check=False)  # compared here
        self.net = FakeNetwork()
        self.workers: list[Worker] = []
        self.history: dict[Key, ExecuteModelRequest] = {}
        self.deltas: dict[Key, Delta] = {}  # every delta published (for retransmissions)
        self.digests: dict[Key, int] = {(1, 0): self.mirror.state.digest}
        self.now = 0.0
        self.coverage: Counter[str] = Counter()
        self.compare = Comparator()
        for _ in range(workers):
            self.join(started)

    @property
    def mirror(self) -> EngineMirror:
        return self.oracle.mirror

    # -- engine ------------------------------------------------------------------------
    def step(self, seed: int) -> ExecuteModelRequest:
        return self.publish(self.model.step(seed))

    def publish(self, request: ExecuteModelRequest) -> ExecuteModelRequest:
        """Diff ``request`` against the mirror, check the mirror, send the delta."""
        delta = self.oracle.diff(request)
        key = (delta.epoch, delta.seq)
        diffs = self.compare.differences(self.oracle.rebuild(), request)
        assert not diffs, f"engine mirror at {key} differs in {diffs}"
        self.history[key], self.digests[key], self.deltas[key] = request, delta.digest, delta
        self.net.publish(delta)
        self._count(request, delta)
        return request

    def _count(self, request: ExecuteModelRequest, delta: Delta) -> None:
        """Which delta features this step exercised (coverage statistics)."""
        b, c = delta.body, self.coverage
        c["truncations"] += b.rare.truncate is not None
        c["block replacements"] += bool(b.rare.block_replace)
        c["unknown finishes"] += bool(b.rare.finished_unknown)
        c["full schedules"] += bool(b.rare.schedule_full)
        c["schedule edits"] += bool(b.schedule_drop or b.schedule_append)
        c["count departures"] += b.scheduled_tokens is not None or b.computed_tokens is not None
        c["same-step id reuse"] += bool(request.finished_req_ids & set(request.req_ids))
        c["preemptions"] += bool(request.preempted_req_ids)
        c["resumptions"] += bool(request.resumed_req_ids)
        c["spec decode steps"] += bool(request.spec_token_ids.values.size)

    def restart(self, keep: bool) -> None:
        m = self.mirror
        self.oracle = Oracle(m.epoch + 1, m.state.token_mode, m.state.kv_groups, check=False)
        self.digests[(self.mirror.epoch, 0)] = self.mirror.state.digest
        self.model.restart(keep)

    def heartbeat(self) -> None:
        epoch, seq, digest = self.mirror.heartbeat_fields()
        self.net.publish(Heartbeat(epoch=epoch, seq=seq, digest=digest))

    # -- workers -----------------------------------------------------------------------
    def join(self, started: bool = False) -> int:
        """A new worker; ``started``: it exists from the epoch's start (``start=``),
        so the engine must not have stepped yet."""
        if not started:
            self.workers.append(Worker())
            return self.net.join()
        m = self.mirror
        assert m.seq == 0
        state = ReplicaState(m.state.token_mode, m.state.kv_groups)
        self.workers.append(Worker(CheckedReplica(start=(m.epoch, state)), anchor=(m.epoch, 0)))
        return self.net.join()

    def missing(self, w: int) -> list[Key]:
        """The deltas a DESYNCED worker of the engine's epoch misses (empty otherwise)."""
        replica = self.workers[w].replica
        if replica.state is not State.DESYNCED or replica.epoch != self.mirror.epoch:
            return []
        return [(replica.epoch, s) for s in range(replica.seq + 1, self.mirror.seq + 1)]

    def retransmit(self, w: int, keys: list[Key], front: bool = False) -> None:
        """Send these published deltas to worker ``w`` again (``front``: in this order,
        ahead of everything in flight)."""
        self.coverage["retransmitted deltas"] += len(keys)
        for key in reversed(keys) if front else keys:
            self.net.send(w, self.deltas[key], front=front)

    def deliver(self, w: int) -> list[ev.Event]:
        msg = codec.decode(self.net.links[w].pop())
        worker = self.workers[w]
        was = worker.replica.state
        events = worker.replica.receive(msg, self.now)
        self.check_events(w, events)
        if was is State.DESYNCED and worker.replica.state is State.SYNCED \
                and not any(isinstance(e, ev.SnapshotLoaded) for e in events):
            self.coverage["recovered by retransmission"] += 1
            worker.wants_snapshot = False
        return events

    def serve_snapshot(self, w: int, front: bool = False) -> None:
        self.workers[w].wants_snapshot = False
        self.net.send(w, self.mirror.snapshot(), front=front)

    def poll(self, dt: float) -> None:
        self.now += dt
        for w, worker in enumerate(self.workers):
            self.check_events(w, worker.replica.poll(self.now))

    def check_events(self, w: int, events: list[ev.Event]) -> None:
        """Invariants 1 and 2, right where the events happen."""
        worker = self.workers[w]
        rebuilt, worker.replica.rebuilt = worker.replica.rebuilt, []
        applied = [e.seq for e in events if isinstance(e, ev.Applied)]
        assert [key[1] for key, _ in rebuilt] == applied, (w, events)
        for e in events:
            if isinstance(e, ev.SnapshotLoaded):
                worker.anchor = (worker.replica.epoch, e.seq)
            elif isinstance(e, ev.Applied):
                key, request = rebuilt.pop(0)
                after = worker.anchor
                assert after is not None and key == (after[0], after[1] + 1), \
                    f"worker {w} applied {key} after {after}: across a gap"
                worker.anchor, worker.applied = key, worker.applied + 1
                diffs = self.compare.differences(request, self.history[key])
                assert not diffs, f"worker {w} step {key} differs in {diffs}"
            elif isinstance(e, ev.NeedSnapshot):
                worker.wants_snapshot = True
            # The fake network loses and reorders but never corrupts: every delta
            # or snapshot a replica tries to use must be acceptable.
            assert not isinstance(e, ev.RejectedDelta), f"worker {w}: {e}"

    def check_synced(self) -> None:
        """Invariant 3: a SYNCED replica is where its events say, with the engine's digest."""
        for w, worker in enumerate(self.workers):
            replica = worker.replica
            if replica.state is not State.SYNCED:
                continue
            assert replica.data is not None
            key = (replica.epoch, replica.seq)
            assert key == worker.anchor, (w, key, worker.anchor)
            assert replica.data.digest == self.digests[key], f"worker {w} digest at {key}"
            if worker.checked != (id(replica.data), *key):  # O(state): once per state
                assert replica.data.digest == replica.data.recompute_digest(), w
                worker.checked = (id(replica.data), *key)

    def stats(self) -> dict[str, int]:
        """Coverage counters (reported as Hypothesis events)."""
        replicas = [w.replica.stats for w in self.workers]
        return {
            "engine steps": len(self.history),
            "applied deltas": sum(w.applied for w in self.workers),
            "snapshots loaded": sum(r["snapshots"] for r in replicas),
            "gaps": sum(r["gaps"] for r in replicas),
            "epochs": self.mirror.epoch,
            **self.coverage,
        }

    def settle(self) -> None:
        """Invariant 4: deliver all in order, then a snapshot; everyone converges."""
        for w in range(len(self.workers)):
            while self.net.links[w].queue:
                self.deliver(w)
            self.serve_snapshot(w)
            self.deliver(w)
        self.check_synced()
        target = (self.mirror.epoch, self.mirror.seq)
        for w, worker in enumerate(self.workers):
            replica = worker.replica
            assert replica.state is State.SYNCED, (w, replica.state)
            assert (replica.epoch, replica.seq) == target, (w, replica.epoch, replica.seq)
            assert replica.data is not None and replica.data.digest == self.mirror.state.digest
