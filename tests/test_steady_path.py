"""The steady-step fast paths (mirror check, look-ahead counts, rebuild template) agree
with the general path over many steps, across look-ahead tables, with fresh columns."""

from __future__ import annotations

from itertools import chain

from engine_side.mirror import EngineMirror
from engine_side.workloads import Workload
from protocol import codec
from protocol.lookahead import MAX_STEPS
from protocol.plan import STEADY_BODY
from protocol.request import request_differences
from worker_side.events import Applied
from worker_side.replica import WorkerReplica


def test_steady_steps_match_the_engine_across_lookahead_tables() -> None:
    workload = Workload("steady_decode", 8, seed=3)
    mirror = EngineMirror(verify=True)
    replica = WorkerReplica(silence_timeout=float("inf"))
    replica.receive(codec.decode(codec.encode(mirror.snapshot())), 0.0)
    steady = 0
    for req in chain(workload.warmup(), (workload.step() for _ in range(3 * MAX_STEPS))):
        delta = mirror.diff(req)
        steady += delta.body == STEADY_BODY
        events = replica.receive(codec.decode(codec.encode(delta)), 0.0)
        assert isinstance(events[-1], Applied)
        got = replica.request()
        assert request_differences(got, req) == []
        got.num_computed_tokens[:] = -1  # a fresh column: the replica must not see this
        got.req_ids.clear()
        assert request_differences(replica.request(), req) == []
    assert steady > 2 * MAX_STEPS
    for state in (mirror.state, replica.data):
        assert state is not None and state.recompute_digest() == state.digest


def test_a_non_steady_count_after_steady_steps_is_sent() -> None:
    workload = Workload("steady_decode", 4, seed=5)
    mirror = EngineMirror(verify=True)
    reqs = list(chain(workload.warmup(), (workload.step() for _ in range(5))))
    for req in reqs:
        mirror.diff(req)
    nxt = workload.step()
    nxt.num_computed_tokens = nxt.num_computed_tokens + 1  # not the predicted advance
    delta = mirror.diff(nxt)
    assert delta.body != STEADY_BODY and delta.body.computed_tokens is not None
