"""The steady lane (``protocol/lane.py``) equals ReplicaState.apply of the same bodies:
the same digest after every step, the same refusals (nothing changed), and after a
settle the same state (recomputed digest, rebuilt request, block tables, step fields)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replica_bodies import first_body

from protocol import digest, lane_lists, packing
from protocol import lane as lane_module
from protocol.errors import InvalidDelta, MalformedMessage
from protocol.lane import MAX_ROWS, MAX_SEGMENTS, Appends, SteadyLane
from protocol.lane_lists import NO_ROWS, lane_rows, lane_shaped
from protocol.messages import DeltaBody, Rows
from protocol.packing import pack_sints, pack_uints
from protocol.plan import STEADY_BODY
from protocol.request import request_differences
from protocol.speedups import C
from protocol.state import ReplicaState


@st.composite
def _appends(draw: st.DrawFn, n: int) -> Appends:
    """One group's appends by batch position: mostly valid, sometimes a repeated or
    outside position, a zero count, an id past int32 or a count/ids mismatch."""
    if n > 33 and draw(st.integers(0, 3)) == 0:  # past dg.SMALL rows: the lane's numpy terms
        pos = draw(st.permutations(range(n)))[:draw(st.integers(33, n))]
    else:
        pos = draw(st.lists(st.integers(0, n - 1), max_size=min(n, 8),
                            unique=draw(st.integers(0, 9)) > 0))
    if pos and draw(st.integers(0, 19)) == 0:
        pos.append(n)
    counts = [1] * len(pos) if draw(st.booleans()) else \
        [draw(st.integers(0 if draw(st.integers(0, 19)) == 0 else 1, 3)) for _ in pos]
    size = sum(counts) + (1 if draw(st.integers(0, 19)) == 0 else 0)
    top = (1 << 32) if draw(st.integers(0, 19)) == 0 else (1 << 31) - 1
    values = draw(st.lists(st.integers(0, top), min_size=size, max_size=size))
    return pos, counts, values


def _body(appends: list[Appends], handles: list[int], extra: dict[str, Any]) -> DeltaBody:
    rows = tuple(Rows(handles=pack_uints([handles[p] if p < len(handles) else len(handles) + 7
                                          for p in pos]),
                      counts=pack_uints(counts), values=pack_uints(values))
                 for pos, counts, values in appends)
    return DeltaBody(block_append=rows if any(a[0] for a in appends) else (), **extra)


@st.composite
def _step(draw: st.DrawFn, n: int, groups: int, handles: list[int],
          ) -> tuple[DeltaBody, list[Appends]]:
    kind = draw(st.sampled_from(["lane"] * 5 + ["steady", "spec", "counts", "counts"]))
    if kind == "steady":
        return STEADY_BODY, []
    appends = [draw(_appends(n)) for _ in range(groups)]
    extra: dict[str, Any] = {}
    if kind == "counts":  # count exceptions (sometimes repeated, outside or negative)
        extra.update(_counts(draw, n))
        if draw(st.booleans()):
            return DeltaBody(**extra), []
    if draw(st.booleans()):
        extra["extension"] = {"v": b"\x80"}
    if kind == "spec":
        lengths = [draw(st.integers(0, 2)) for _ in range(n)]
        size = sum(lengths) + (1 if draw(st.integers(0, 9)) == 0 else 0)
        extra["spec_tokens"] = Rows(counts=pack_uints(lengths),
                                    values=pack_uints(list(range(1, size + 1))))
        extra["has_structured_output"] = draw(st.booleans())
        extra["num_spec_tokens_to_schedule"] = draw(st.integers(0, 3))
    return _body(appends, handles, extra), appends


def _counts(draw: st.DrawFn, n: int) -> dict[str, Rows]:
    out = {}
    for name, low in (("computed_tokens", -12), ("scheduled_tokens", 0)):
        if draw(st.booleans()):
            pos = draw(st.lists(st.integers(0, n), max_size=3,
                                unique=draw(st.integers(0, 9)) > 0))
            vals = [draw(st.integers(low, 4)) for _ in pos]
            if draw(st.integers(0, 19)) == 0:
                vals.append(1)
            out[name] = Rows(handles=pack_uints(pos),
                             values=pack_sints(vals) if low else pack_uints(vals))
    return out


def _outcome(apply: Callable[..., object], *args: object) -> str:
    try:
        apply(*args)
    except (InvalidDelta, MalformedMessage) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _well_formed(appends: list[Appends], n: int) -> bool:
    """Appends as the engine makes them: increasing scheduled positions, >= 1 id each."""
    return all(pos == sorted(set(pos)) and all(0 <= p < n for p in pos) and len(counts) == len(pos)
               and all(c >= 1 for c in counts) and sum(counts) == len(values)
               for pos, counts, values in appends)


def _lane_apply(lane: SteadyLane, state: ReplicaState, body: DeltaBody, appends: list[Appends],
                expected: int | None, own: bool = False, quick: bool = False) -> None:
    """The adapter's use: the lane when it takes the body, else settle and apply
    (``own``: the appends are vouched for, as the engine's own; ``quick``: a body of one
    group's appends and no count or draft rows goes to ``appended`` first, as the
    adapter's same-batch steps do)."""
    if (quick and len(appends) == 1 and lane_shaped(body)
            and lane_rows(body, len(state.schedule)) is NO_ROWS
            and lane.appended(appends[0], expected, body, own) is not None):
        return
    if lane.step(body, appends, expected, own_appends=own) is None:  # not lane-shaped
        lane.settle()
        state.apply(body, expected_digest=expected)


def _same_state(a: ReplicaState, b: ReplicaState) -> None:
    assert a.digest == b.digest == a.recompute_digest()
    assert request_differences(a.rebuild(), b.rebuild()) == []
    for ta, tb in zip(a.blocks, b.blocks, strict=True):
        for h in b.live_handles().tolist():
            assert ta[h].tolist() == tb[h].tolist()
    live = b.live_handles()  # the per-handle digest sums a finish subtracts
    assert a.cols.block_sum[:, live].tolist() == b.cols.block_sum[:, live].tolist()
    # what the planner of a changed schedule reads: the last scheduled counts
    assert a.cols.last_nsched[live].tolist() == b.cols.last_nsched[live].tolist()
    # a handle that is not live holds no blocks (an add takes its row as it is)
    for state in (a, b):
        dead = ~state.cols.live
        assert not state.cols.block_sum[:, dead].any()
        assert not any(table.lengths[:dead.size][dead].any() for table in state.blocks)
    assert a.step.extension == b.step.extension
    assert a.step.has_structured_output == b.step.has_structured_output
    assert a.step.num_spec_tokens_to_schedule == b.step.num_spec_tokens_to_schedule


@pytest.fixture(params=["c", "pure"])
def speedups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the C speedups and again on the lane's pure-Python paths."""
    if request.param == "pure":
        for module in (lane_module, lane_lists, digest, packing):
            monkeypatch.setattr(module, "_C", None)
    elif C is None:
        pytest.skip("C speedups not built")
    return str(request.param)


@settings(max_examples=80, deadline=None,  # the fixture only patches modules: shared is fine
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(1, 48), st.integers(1, 2), st.data())
def test_the_lane_equals_applying_every_body(speedups: str, n: int, groups: int,
                                             data: st.DataObject) -> None:
    laned, reference = ReplicaState(kv_groups=groups), ReplicaState(kv_groups=groups)
    first = first_body(n, groups)
    for state in (laned, reference):
        state.apply(first)
    lane = SteadyLane(laned)
    handles = laned.schedule.tolist()
    for _ in range(data.draw(st.integers(1, 30))):
        body, appends = data.draw(_step(n, groups, handles))
        expected = None if data.draw(st.integers(0, 5)) else data.draw(
            st.sampled_from([reference.digest, 12345]))
        own = _well_formed(appends, n) and data.draw(st.booleans())
        quick = data.draw(st.booleans())
        if data.draw(st.integers(0, 4)) == 0:  # as the adapters do after a general step
            # (harmless at any point; with the state's counts, as they pass them, which
            # the lane takes only when nothing is journaled)
            lane.open(laned.cols.computed[laned.schedule].tolist()
                      if data.draw(st.booleans()) else None)
        error = _outcome(_lane_apply, lane, laned, body, appends, expected, own, quick)
        assert error == _outcome(reference.apply, body, expected)
        assert (lane.digest if lane.steps else laned.digest) == reference.digest
        if data.draw(st.integers(0, 3)) == 0:
            lane.settle()
            _same_state(laned, reference)
    lane.settle()
    _same_state(laned, reference)


def test_a_digest_mismatch_changes_nothing() -> None:
    state, reference = ReplicaState(), ReplicaState()
    for s in (state, reference):
        s.apply(first_body(4, 1))
    lane = SteadyLane(state)
    appends = [([1], [1], [77])]
    body = _body(appends, state.schedule.tolist(), {})
    lane.step(STEADY_BODY, [])
    before = (lane.digest, lane.steps, [list(x) for x in lane.lengths], state.version)
    with pytest.raises(InvalidDelta, match="digest mismatch"):
        lane.step(body, appends, expected_digest=1)
    assert (lane.digest, lane.steps, lane.lengths, state.version) == before
    reference.apply(STEADY_BODY)
    reference.apply(body)
    assert lane.step(body, appends, reference.digest) == reference.digest
    lane.settle()
    _same_state(state, reference)


def test_appended_refuses_what_step_must_decide() -> None:
    """``appended`` takes one KV group's non-empty appends only; anything else is
    None with nothing done (the adapter then calls ``step``)."""
    two = ReplicaState(kv_groups=2)
    two.apply(first_body(4, 2))
    lane = SteadyLane(two)
    assert lane.appended(([1], [1], [77]), None) is None  # two groups
    one = ReplicaState()
    one.apply(first_body(4, 1))
    lane = SteadyLane(one)
    assert lane.appended(([], [], []), None) is None  # no rows
    assert lane.appended(([9], [1], [77]), None) is None  # position not scheduled
    assert lane.appended(([1], [1], [1 << 40]), None, own=True) is None  # id past int32
    assert lane.steps == 0 and lane.digest == one.digest
    lengths = [list(x) for x in lane.lengths]
    with pytest.raises(InvalidDelta, match="digest mismatch"):
        lane.appended(([1], [1], [77]), expected_digest=1)
    assert lane.steps == 0 and lane.digest == one.digest and lane.lengths == lengths


def test_the_lane_settles_itself_before_its_journal_grows_unbounded() -> None:
    state = ReplicaState()
    state.apply(first_body(4, 1))
    lane = SteadyLane(state)
    handles = state.schedule.tolist()
    appends = [([0, 1, 2, 3], [1, 1, 1, 1], [5, 6, 7, 8])]
    body = _body(appends, handles, {})
    for _ in range(MAX_ROWS // 4 + 2):
        lane.step(body, appends)
    assert lane.rows <= MAX_ROWS and state.version > 1
    lane.settle()
    assert state.digest == state.recompute_digest()


@pytest.mark.parametrize(("moves", "max_rows", "bound"), [
    (True, MAX_ROWS, MAX_ROWS // 4), (False, MAX_ROWS, MAX_SEGMENTS),
    (True, 16, MAX_SEGMENTS)])  # a batch too large for MAX_SEGMENTS changes: no fewer
def test_a_lane_keeping_computed_counts_journals_count_changes_up_to_its_bound(
        moves: bool, max_rows: int, bound: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative decoding changes the scheduled counts every step: a lane that keeps
    the computed counts journals those changes until they hold MAX_ROWS counts (one
    lookup-bound settle every MAX_SEGMENTS steps would cost those steps tens of µs),
    never fewer than MAX_SEGMENTS; one that does not keep them settles past
    MAX_SEGMENTS."""
    monkeypatch.setattr(lane_module, "MAX_ROWS", max_rows)
    state = ReplicaState()
    state.apply(first_body(4, 1))
    lane = SteadyLane(state)
    steps = 0
    while state.version == 1:
        body = DeltaBody(scheduled_tokens=Rows(pack_uints([0]), values=pack_uints(
            [1 + steps % 2])), computed_tokens=Rows(pack_uints([1]), values=pack_sints(
                [1])) if moves else None)
        assert lane.step(body, []) is not None
        steps += 1
    assert abs(steps - bound) <= 1  # (the first segment is the opening counts')
    assert state.digest == state.recompute_digest()


def test_appends_to_rows_ending_at_one_offset_rebuild_in_batch_order() -> None:
    """Found by the lane property test: the cached flat table patched with appends to
    a row and to the empty row after it (both end at one offset) put the later row's
    block first when the body named it first."""
    state = ReplicaState()
    state.apply(first_body(4, 1))  # rows of 0, 1, 2 and 0 blocks
    state.rebuild()  # caches the flat table that appends then patch
    handles = state.schedule.tolist()
    state.apply(_body([([3, 2], [1, 1], [76, 97])], handles, {}))
    table = state.rebuild().block_tables[0]
    assert table.values.tolist() == state.blocks[0].gather(state.schedule)[1].tolist()
    assert table.values.tolist()[-2:] == [97, 76]


@pytest.mark.parametrize("rows", [1, 40])  # the Python-int path and the numpy path
def test_a_block_id_past_int32_is_refused_and_changes_nothing(rows: int) -> None:
    """Found by the lane property test: the int32 tables silently truncated it."""
    state = ReplicaState()
    state.apply(first_body(40, 1))
    before = state.digest
    pos = list(range(rows))
    body = _body([(pos, [1] * rows, [5] * (rows - 1) + [1 << 31])], state.schedule.tolist(), {})
    with pytest.raises(InvalidDelta, match="31 bits"):
        state.apply(body)
    assert state.digest == before == state.recompute_digest()
    assert SteadyLane(state).step(body, [(pos, [1] * rows, [5] * (rows - 1) + [1 << 31])]) \
        is None
