"""Many requests joining at once: the planner's digest terms and the state's install
by columns (``plan._Planner._mark_added``, ``ReplicaState._install_all``) give what the
one-by-one lines give -- the same digest, columns, capacities, specs and tokens --,
for new handles past the columns' capacity, for live handles an add replaces, and in
both token modes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replica_bodies import first_body

from protocol import plan as plan_module
from protocol import state_rows as state_module
from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER, DeltaBody, NewRequest
from protocol.packing import pack_uints
from protocol.state import ReplicaState

_COLUMNS = ("live", "in_sched", "computed", "spec_term", "token_sum", "block_sum",
            "last_nsched")


def _adds(handles: list[int], mode: int, data: st.DataObject) -> DeltaBody:
    """A body adding ``handles`` (prompts, computed counts and, in engine-token mode,
    output tokens drawn) and scheduling them with one token each."""
    added = []
    for h in handles:
        prompt = data.draw(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=6))
        output = data.draw(st.lists(st.integers(0, 999), max_size=3)) \
            if mode == TOKEN_MODE_ENGINE else []
        added.append(NewRequest(
            handle=h, req_id=f"j{h}", prompt=pack_uints(prompt),
            num_computed=data.draw(st.integers(0, 1 << 40)),
            output=pack_uints(output) if output else b""))
    return DeltaBody(added=tuple(added), schedule_full=pack_uints(handles))


def _same(many: ReplicaState, one: ReplicaState) -> None:
    assert many.digest == one.digest == many.recompute_digest()
    for name in _COLUMNS:
        assert getattr(many.cols, name).tolist() == getattr(one.cols, name).tolist(), name
    assert [t.lengths.tolist() for t in many.blocks] == [t.lengths.tolist() for t in one.blocks]
    assert [t.table.shape for t in many.blocks] == [t.table.shape for t in one.blocks]
    kept = [[x is None or (x.req_id if hasattr(x, "req_id") else x.view().tolist())
             for x in lst] for lst in (many.specs, many.tokens, one.specs, one.tokens)]
    assert kept[:2] == kept[2:]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 2), st.sampled_from([TOKEN_MODE_WORKER,
                                                                TOKEN_MODE_ENGINE]),
       st.data())
def test_many_joins_install_as_one_by_one(n: int, groups: int, mode: int,
                                          data: st.DataObject) -> None:
    """A join of more than a few requests (some replacing live handles, some past the
    capacity) reads and writes by columns: the same state as the one-by-one lines."""
    one, many = (ReplicaState(mode, kv_groups=groups) for _ in range(2))
    for state in (one, many):
        state.apply(first_body(n, groups))
    few = max(plan_module.FEW_ADDED, state_module.FEW_INSTALLED)
    replaced = data.draw(st.sets(st.integers(0, n - 1), max_size=n))
    fresh = data.draw(st.sets(st.integers(n, 300), min_size=max(0, few + 1 - len(replaced)),
                              max_size=few + 30))
    handles = data.draw(st.permutations(sorted(replaced | fresh)))
    body = _adds(list(handles), mode, data)
    with pytest.MonkeyPatch.context() as patch:  # (the one-by-one lines, for any count)
        patch.setattr(plan_module, "FEW_ADDED", len(handles))
        patch.setattr(state_module, "FEW_INSTALLED", len(handles))
        one.apply(body)
    many.apply(body)
    _same(many, one)
    assert all(many.specs[h].req_id == f"j{h}" for h in handles)  # type: ignore[union-attr]


def test_a_join_past_int64_counts_takes_the_one_by_one_lines() -> None:
    """A computed count numpy's int64 cannot hold is read as the one-by-one lines read
    it (the columns path steps aside rather than raise OverflowError itself)."""
    state, big = ReplicaState(), (1 << 63) + 5
    adds = tuple(NewRequest(handle=h, req_id=f"j{h}", prompt=pack_uints([1]),
                            num_computed=big if h == 3 else 1) for h in range(20))
    body = DeltaBody(added=adds, schedule_full=pack_uints(list(range(20))))
    one = ReplicaState()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plan_module, "FEW_ADDED", 100)
        patch.setattr(state_module, "FEW_INSTALLED", 100)
        want = _error(one, body)
    assert _error(state, body) == want


def _error(state: ReplicaState, body: DeltaBody) -> str:
    try:
        state.apply(body)
    except Exception as exc:  # noqa: BLE001 - compared, whatever it is
        return type(exc).__name__
    return ""
