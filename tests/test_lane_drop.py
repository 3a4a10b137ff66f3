"""The finish step (``protocol/lane_drop.py``) equals ReplicaState.apply of the whole
body: requests finish and leave the schedule, then a lane step of the stayers' rows on
a new lane.  The same digest, the same refusals with nothing changed, and after a
settle the same state (recomputed digest, rebuilt request, tables, step fields)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace
from replica_bodies import first_body
from test_lane import (  # (speedups: the lane tests' fixture, with C and pure Python)
    _lane_apply,
    _outcome,
    _same_state,
    _step,
    _well_formed,
    speedups,  # noqa: F401
)

from protocol import lane_drop
from protocol import state_rows as state_module
from protocol.errors import InvalidDelta, MalformedMessage
from protocol.lane import Appends, SteadyLane
from protocol.lane_drop import commit_drop, drop_lane
from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER, DeltaBody
from protocol.packing import pack_uints
from protocol.state import ReplicaState


def _finish(lane: SteadyLane, state: ReplicaState, drop: list[int], body: DeltaBody,
            appends: list[Appends], expected: int | None, own: bool) -> SteadyLane:
    """The adapters' use: the finish and the rows' lane step, committed when both take
    them; else (the lane does not take the rows) the state applies the whole body."""
    finished = sorted(state.schedule[drop].tolist())
    whole = replace(body, finished=pack_uints(finished), schedule_drop=pack_uints(drop))
    opened = drop_lane(lane, finished, drop)
    assert opened is not None
    new, plan = opened
    if new.step(body, appends, expected, own_appends=own) is None:
        state.apply(whole, expected_digest=expected)  # (the old lane is settled)
        return lane
    commit_drop(new, plan)
    return new


def _steps(data: st.DataObject, lane: SteadyLane, laned: ReplicaState,
           reference: ReplicaState, groups: int) -> SteadyLane:
    """A few lane steps, each on both states, the outcomes compared."""
    n, handles = len(laned.schedule), laned.schedule.tolist()
    for _ in range(data.draw(st.integers(0, 4))):
        body, appends = data.draw(_step(n, groups, handles))
        error = _outcome(_lane_apply, lane, laned, body, appends, None, False)
        assert error == _outcome(reference.apply, body)
    return lane


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(2, 40), st.integers(1, 2), st.data())
@pytest.mark.usefixtures("speedups")
def test_a_finish_equals_applying_the_whole_body(n: int, groups: int,
                                                 data: st.DataObject) -> None:
    laned, reference = ReplicaState(kv_groups=groups), ReplicaState(kv_groups=groups)
    for state in (laned, reference):
        state.apply(first_body(n, groups))
    lane = SteadyLane(laned)
    for _ in range(data.draw(st.integers(1, 3))):
        lane = _steps(data, lane, laned, reference, groups)
        size = len(laned.schedule)
        if size < 2:
            break
        drop = sorted(data.draw(st.sets(st.integers(0, size - 1), min_size=1,
                                        max_size=size - 1)))
        stay = [h for p, h in enumerate(laned.schedule.tolist()) if p not in drop]
        body, appends = data.draw(_step(len(stay), groups, stay))
        whole = replace(body, finished=pack_uints(sorted(laned.schedule[drop].tolist())),
                        schedule_drop=pack_uints(drop))
        expected = None if data.draw(st.integers(0, 3)) else data.draw(
            st.sampled_from([None, 12345]))
        own = _well_formed(appends, len(stay)) and data.draw(st.booleans())
        before = laned.digest if not lane.steps else lane.digest
        try:
            lane, error = _finish(lane, laned, drop, body, appends, expected, own), ""
        except (InvalidDelta, MalformedMessage) as exc:
            error = f"{type(exc).__name__}: {exc}"
        assert error == _outcome(reference.apply, whole, expected)
        if error:  # nothing changed: the old lane, settled, is still the state's
            assert laned.digest == before == reference.digest
        assert (lane.digest if lane.steps else laned.digest) == reference.digest
    lane.settle()
    _same_state(laned, reference)



@settings(max_examples=40, deadline=None)
@given(st.integers(9, 40), st.integers(1, 2), st.sampled_from([TOKEN_MODE_WORKER,
                                                                 TOKEN_MODE_ENGINE]),
       st.data())
def test_many_finishes_read_and_forget_as_one_by_one(n: int, groups: int, mode: int,
                                                     data: st.DataObject) -> None:
    """Past a few handles, a finish reads the digest terms by column gathers and forgets
    by column scatters: the same terms and the same columns as one handle at a time."""
    one, many = (ReplicaState(mode, kv_groups=groups) for _ in range(2))
    for state in (one, many):
        state.apply(first_body(n, groups))
    finished = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=lane_drop.FEW_FINISHED
                                        + 1, max_size=n)))
    finished = one.schedule[finished].tolist()
    with pytest.MonkeyPatch.context() as patch:  # (the one-by-one lines, for any count)
        patch.setattr(lane_drop, "FEW_FINISHED", n)
        patch.setattr(state_module, "FEW_FORGOTTEN", n)
        want = lane_drop._terms(one, finished)
        one._forget_all(finished)
    assert lane_drop._terms(many, finished) == want
    many._forget_all(finished)
    for name in ("live", "in_sched", "computed", "spec_term", "token_sum", "block_sum"):
        assert getattr(many.cols, name).tolist() == getattr(one.cols, name).tolist(), name
    assert [t.lengths.tolist() for t in many.blocks] == [t.lengths.tolist() for t in one.blocks]
    kept = [[x is None or (x.req_id if hasattr(x, "req_id") else x.view().tolist())
             for x in lst] for lst in (many.specs, many.tokens, one.specs, one.tokens)]
    assert kept[:2] == kept[2:]  # the same rows forgotten, the rest unchanged
    assert not many._rebuild_cache and many.cols.live[finished].sum() == 0
    # (both paths share the writes: the forgotten rows are cleared, not only alike)
    assert not many.cols.in_sched[finished].any() and not many.cols.block_sum[:, finished].any()
    assert all(not t.lengths[finished].any() for t in many.blocks)
    assert all(many.specs[h] is None for h in finished)
