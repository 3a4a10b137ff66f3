"""Convergence of engine mirror and worker replicas over a lossy network (model-based).

A random engine workload (``tests/engine_model.py``) produces one full
``ExecuteModelRequest`` per step; a :class:`RequestDiffer` turns it into the
:class:`EngineMirror`'s Delta, which travels as bytes through ``tests/fakenet.py`` to
several :class:`WorkerReplica`s, with loss, duplication, reordering, late joins,
replicas there from the epoch's start (``start=``), heartbeats, snapshots on request,
retransmissions of the deltas a desynced replica missed, and engine restarts.
Checked throughout:

1. every applied step rebuilds (``rebuild_request``) exactly the engine's request for
   that step, and no genuine delta or snapshot is ever rejected;
2. a replica never applies across a gap: after ``SnapshotLoaded(s)`` (or its start at
   ``s = 0``) it applies ``s + 1, s + 2, ...`` of the same epoch and nothing else;
3. a SYNCED replica's digest is consistent and equals the engine's at its seq;
4. after delivering everything plus a snapshot, all replicas are SYNCED at the
   engine's seq with the engine's digest (``settle``, also run at teardown).

The harness that runs them and makes every check is ``tests/sync_harness.py``.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
from hypothesis import event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sync_harness import Harness

from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
from worker_side import events as ev
from worker_side.replica import State

SEEDS = st.integers(0, 2**32 - 1)


def _bucket(n: int) -> str:
    """Coarse ranges for ``hypothesis.event`` statistics."""
    return next(f"<{b}" for b in (1, 5, 20, 50, 100, 10**9) if n < b)


class SyncMachine(RuleBasedStateMachine):
    """One engine, 1-4 workers, a lossy network; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._h: Harness | None = None
        self.seed = 0

    @property
    def h(self) -> Harness:
        assert self._h is not None
        return self._h

    @initialize(token_mode=st.sampled_from([TOKEN_MODE_WORKER, TOKEN_MODE_ENGINE]),
                kv_groups=st.sampled_from([1, 2]), workers=st.integers(1, 3),
                start=st.sampled_from(["cold", "warm", "started"]), seed=SEEDS)
    def start(self, token_mode: int, kv_groups: int, workers: int, start: str,
              seed: int) -> None:
        self._h = Harness(token_mode, kv_groups, workers, started=start == "started")
        self.seed = seed  # engine steps draw nothing: their seeds follow from this one
        self.h.poll(0.0)  # joining replicas ask for a snapshot
        for w in range(workers if start == "warm" else 0):  # the snapshot at seq 0 arrived
            self.h.serve_snapshot(w)
            self.h.deliver(w)

    # -- workload --------------------------------------------------------------------
    def _steps(self, steps: int) -> None:
        for _ in range(steps):
            self.seed = random.Random(self.seed).getrandbits(32)
            for change in self.h.model.churn(self.seed):
                note(change)
            request = self.h.step(self.seed + 1)
            note(f"step {self.h.mirror.epoch}:{self.h.mirror.seq} batch={request.req_ids} "
                 f"sched={request.num_scheduled_tokens.tolist()} "
                 f"finished={sorted(request.finished_req_ids)}")

    @rule()
    def engine_step(self) -> None:
        """Workload churn (adds, finishes, preemptions...) then one step."""
        self._steps(1)

    @rule(steps=st.integers(2, 5))
    def engine_burst(self, steps: int) -> None:
        self._steps(steps)

    @rule(seed=SEEDS)
    def add_request(self, seed: int) -> None:
        note(f"add {self.h.model.add_request(seed)}")

    @precondition(lambda self: bool(self.h.model.live))
    @rule(seed=SEEDS)
    def finish_request(self, seed: int) -> None:
        note(f"finish {self.h.model.finish(seed)}")

    @precondition(lambda self: bool(self.h.model.live))
    @rule(seed=SEEDS)
    def reuse_id(self, seed: int) -> None:
        note(f"finish and re-add {self.h.model.reuse_id(seed)}")

    @precondition(lambda self: bool(self.h.model.preemptible()))
    @rule(seed=SEEDS)
    def preempt(self, seed: int) -> None:
        note(f"preempt {self.h.model.preempt(seed)}")

    @precondition(lambda self: bool(self.h.model.resumable()))
    @rule(seed=SEEDS)
    def resume(self, seed: int) -> None:
        note(f"resume {self.h.model.resume(seed)}")

    @precondition(lambda self: bool(self.h.model.live))
    @rule(seed=SEEDS)
    def update_params(self, seed: int) -> None:
        note(f"new params for {self.h.model.update_params(seed)}")

    @rule(keep=st.booleans())
    def restart_engine(self, keep: bool) -> None:
        self.h.restart(keep)
        note(f"engine restarted as epoch {self.h.mirror.epoch} (keep requests: {keep})")

    # -- network -----------------------------------------------------------------------
    @precondition(lambda self: bool(self.h.net.busy()))
    @rule(data=st.data(), count=st.integers(1, 4))
    def deliver(self, data: st.DataObject, count: int) -> None:
        w = data.draw(st.sampled_from(self.h.net.busy()), label="worker")
        for _ in range(min(count, len(self.h.net.links[w].queue))):
            note(f"worker {w} <- {self.h.deliver(w)}")

    @precondition(lambda self: bool(self.h.net.busy()))
    @rule(data=st.data())
    def flush(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(self.h.net.busy()), label="worker")
        while self.h.net.links[w].queue:
            note(f"worker {w} <- {self.h.deliver(w)}")

    @precondition(lambda self: bool(self.h.net.busy()))
    @rule(data=st.data(), kind=st.sampled_from(["drop", "duplicate", "reorder"]))
    def fault(self, data: st.DataObject, kind: str) -> None:
        w = data.draw(st.sampled_from(self.h.net.busy()), label="worker")
        link = self.h.net.links[w]
        i = data.draw(st.integers(0, len(link.queue) - 1), label="message")
        if kind == "drop":
            link.drop(i)
        elif kind == "duplicate":
            link.duplicate(i)
        elif i + 1 < len(link.queue):
            j = data.draw(st.integers(i + 1, len(link.queue) - 1), label="other")
            link.swap(i, j)
            kind = f"swap with {j}"
        note(f"{kind}: message {i} to worker {w}")

    @precondition(lambda self: len(self.h.workers) < 4)
    @rule()
    def join_late(self) -> None:
        note(f"worker {self.h.join()} joins at seq {self.h.mirror.seq}")

    @rule()
    def heartbeat(self) -> None:
        self.h.heartbeat()

    @rule()
    def keyframe(self) -> None:
        """A snapshot published to everyone (periodic resync without back-chatter)."""
        self.h.net.publish(self.h.mirror.snapshot())

    @rule(dt=st.sampled_from([0.1, 0.6, 2.0]))
    def advance_time(self, dt: float) -> None:
        self.h.poll(dt)

    @precondition(lambda self: any(w.wants_snapshot for w in self.h.workers))
    @rule(data=st.data(), front=st.booleans())
    def serve_snapshot(self, data: st.DataObject, front: bool) -> None:
        wanting = [i for i, w in enumerate(self.h.workers) if w.wants_snapshot]
        w = data.draw(st.sampled_from(wanting), label="worker")
        self.h.serve_snapshot(w, front)
        note(f"snapshot at {self.h.mirror.seq} queued for worker {w} (front: {front})")

    @precondition(lambda self: any(self.h.missing(w) for w in range(len(self.h.workers))))
    @rule(data=st.data(), front=st.booleans(), how=st.sampled_from(["all", "first", "some"]))
    def retransmit(self, data: st.DataObject, front: bool, how: str) -> None:
        """Recovery without a snapshot: the engine sends a desynced worker (of its epoch)
        the deltas it missed -- all of them, only the first, or a random subset."""
        wanting = [w for w in range(len(self.h.workers)) if self.h.missing(w)]
        w = data.draw(st.sampled_from(wanting), label="worker")
        keys = self.h.missing(w)
        if how == "first":
            keys = keys[:1]
        elif how == "some":
            keys = data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True),
                             label="deltas")
        self.h.retransmit(w, keys, front)
        note(f"retransmit {[k[1] for k in keys]} to worker {w} (front: {front})")

    @precondition(lambda self: any(w.wants_snapshot for w in self.h.workers))
    @rule(data=st.data())
    def lose_snapshot_request(self, data: st.DataObject) -> None:
        wanting = [i for i, w in enumerate(self.h.workers) if w.wants_snapshot]
        w = data.draw(st.sampled_from(wanting), label="worker")
        self.h.workers[w].wants_snapshot = False  # a poll retry will ask again

    @rule()
    def settle(self) -> None:
        self.h.settle()

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def synced_replicas_match_engine(self) -> None:
        if self._h is not None:
            self.h.check_synced()

    def teardown(self) -> None:
        # Convergence at the end of every run, unless the run already failed.
        if self._h is not None and sys.exc_info()[0] is None:
            self.h.settle()
            stats = self.h.stats()
            for name, value in stats.items():
                event(f"{name}: {_bucket(value)}")


SyncMachine.TestCase.settings = settings(stateful_step_count=50)
TestSyncStateful = SyncMachine.TestCase


# -- deterministic scenarios ---------------------------------------------------------------
def _synced_harness(token_mode: int, kv_groups: int, workers: int,
                    started: bool = False) -> Harness:
    """A harness whose workers have loaded the initial snapshot (or, ``started``,
    exist from the epoch's start)."""
    h = Harness(token_mode, kv_groups, workers, started=started)
    if started:
        return h
    h.poll(0.0)
    for w in range(workers):
        assert h.workers[w].wants_snapshot
        h.serve_snapshot(w)
        h.deliver(w)
    return h


def _step_and_deliver(h: Harness, seed: int) -> None:
    h.step(seed)
    for w in range(len(h.workers)):
        while h.net.links[w].queue:
            h.deliver(w)
    h.check_synced()
    for worker in h.workers:
        assert worker.anchor == (h.mirror.epoch, h.mirror.seq)


@pytest.mark.parametrize("started", [False, True])
@pytest.mark.parametrize("token_mode", [TOKEN_MODE_WORKER, TOKEN_MODE_ENGINE])
@pytest.mark.parametrize("kv_groups", [1, 2])
def test_scripted_lossless(token_mode: int, kv_groups: int, started: bool) -> None:
    """Adds, prefills, decodes, preemption, resume, id reuse; equality at every step."""
    h = _synced_harness(token_mode, kv_groups, workers=2, started=started)
    m = h.model
    for seed in range(4):
        m.add_request(seed)
    for seed in range(100, 108):
        _step_and_deliver(h, seed)
    m.preempt(1)
    _step_and_deliver(h, 200)
    assert h.history[(1, h.mirror.seq)].preempted_req_ids
    m.resume(2)
    _step_and_deliver(h, 201)
    assert h.history[(1, h.mirror.seq)].resumed_req_ids
    reused = m.reuse_id(3)
    _step_and_deliver(h, 202)
    assert reused in h.history[(1, h.mirror.seq)].finished_req_ids
    m.finish(4)
    m.add_request(5)
    for seed in range(300, 310):
        _step_and_deliver(h, seed)
    for seed in range(400, 500, 2):  # random churn: long prompts, sliding windows, ...
        m.churn(seed)
        _step_and_deliver(h, seed + 1)
    assert all(w.applied == h.mirror.seq for w in h.workers)
    assert sum(h.coverage.values()) > 0


def test_drop_then_snapshot() -> None:
    """A lost delta is detected at the next one; a snapshot and buffered deltas heal it."""
    h = _synced_harness(TOKEN_MODE_ENGINE, 2, workers=2)
    for seed in range(5):
        h.model.add_request(seed)
    for seed in range(10, 14):
        _step_and_deliver(h, seed)
    h.step(20)
    h.net.links[1].drop(0)  # worker 1 misses this step
    h.step(21)
    h.step(22)
    h.deliver(0), h.deliver(0), h.deliver(0)
    gap = h.deliver(1)
    assert any(isinstance(e, ev.GapDetected) for e in gap), gap
    assert h.workers[1].replica.state is State.DESYNCED and h.workers[1].wants_snapshot
    h.step(23)  # more steps while the snapshot request is in flight
    h.serve_snapshot(1, front=True)  # out of band: overtakes the queued deltas
    loaded = h.deliver(1)
    assert any(isinstance(e, ev.SnapshotLoaded) for e in loaded), loaded
    while h.net.links[1].queue:
        h.deliver(1)  # the queued deltas (seq 7, 8) are stale now
    _step_and_deliver(h, 24)
    assert h.workers[1].replica.state is State.SYNCED
    assert h.workers[1].replica.seq == h.workers[0].replica.seq == h.mirror.seq


@pytest.mark.parametrize("front", [False, True])
def test_drop_then_retransmit(front: bool) -> None:
    """Lost deltas are detected at the next one; the engine sends the missing ones again
    and the replica applies them and the buffered ones after them: SYNCED, no snapshot."""
    h = _synced_harness(TOKEN_MODE_ENGINE, 2, workers=2, started=True)
    for seed in range(5):
        h.model.add_request(seed)
    for seed in range(10, 14):
        _step_and_deliver(h, seed)
    for seed in range(20, 24):
        h.step(seed)
    h.net.links[1].drop(0)  # worker 1 misses steps 5 and 6
    h.net.links[1].drop(0)
    h.deliver(1)
    assert h.workers[1].replica.state is State.DESYNCED and h.workers[1].wants_snapshot
    assert h.missing(1) == [(1, 5), (1, 6), (1, 7), (1, 8)]
    h.retransmit(1, h.missing(1)[:2], front=front)  # only what was lost
    while h.net.links[1].queue:
        h.deliver(1)
    assert h.workers[1].replica.state is State.SYNCED and not h.workers[1].wants_snapshot
    assert h.workers[1].replica.stats["snapshots"] == 0
    assert h.coverage["recovered by retransmission"] == 1
    _step_and_deliver(h, 24)
    assert h.workers[1].applied == h.mirror.seq


def test_engine_tokens_edited_before_the_last_token() -> None:
    """A history rewritten in the middle whose last token still matches is a truncation."""
    h = _synced_harness(TOKEN_MODE_ENGINE, 1, workers=1)
    spec = RequestSpec("r", np.arange(20, dtype=np.int64))
    for step, tokens in enumerate([[], [1, 2, 3], [1, 4, 3], [1, 4, 3, 5], [1, 4]]):
        h.publish(ExecuteModelRequest(
            req_ids=["r"], specs=[spec], num_scheduled_tokens=np.ones(1, dtype=np.int64),
            num_computed_tokens=np.array([20 + step], dtype=np.int64),
            block_tables=(Ragged.from_lists([[1, 2]]),), spec_token_ids=Ragged.empty(1),
            encoder_inputs=Ragged.empty(1), output_token_ids=[np.array(tokens, dtype=np.int64)]))
        h.deliver(0)
        assert h.workers[0].anchor == (1, step + 1)
